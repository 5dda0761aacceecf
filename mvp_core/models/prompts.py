"""A prompt from submission to its end: the request, its stream events, the head node's
generate input, and the outcome a prompt workflow returns."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from mvp_core import names
from mvp_core.constrain import MAX_FORMAT_BYTES, SchemaError, compile_format, format_text
from mvp_core.errors import ErrorType
from mvp_core.models._base import _DAY_S, _U32, _U64, _Model
from mvp_core.models.policies import NodeLossPolicy
from mvp_core.request_ids import request_id_problem

MAX_TOP_LOGPROBS = 20
"""The most alternatives a prompt may ask log probabilities of per token (OpenAI's chat
limit; the token-out record is sized for it: mvp_core.planner.TOKEN_OUT_BYTES)."""


class ChatMessage(_Model):
    """One message of a conversation, rendered on the head node with the model's own
    chat template (``SubmitPrompt.messages``)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=1_000_000)


class ResponseFormat(_Model):
    """The shape the generated text must have (DECISIONS 89): any JSON object, or a JSON
    value valid under ``json_schema`` (the subset mvp_core.constrain compiles). The last
    stage masks each step's logits to the tokens that keep the text on course. A format
    the compiler refuses, or whose JSON exceeds 16 KiB, is refused here."""

    type: Literal["json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(
        default=None, description="With json_schema: the JSON Schema the text validates against"
    )

    def spec(self) -> dict[str, Any]:
        """The format as mvp_core.constrain.compile_format takes it."""
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "schema": self.json_schema}

    def text(self) -> str:
        """Its canonical JSON: what the pipeline's begin record carries."""
        return format_text(self.spec())

    @model_validator(mode="after")
    def _compiles(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema (the schema) goes with type json_schema, and only there")
        size = len(self.text().encode())
        if size > MAX_FORMAT_BYTES:
            raise ValueError(f"the format's JSON is {size} bytes; at most {MAX_FORMAT_BYTES}")
        try:
            compile_format(self.spec())
        except SchemaError as err:
            raise ValueError(f"json_schema: {err}") from None
        return self


class SubmitPrompt(_Model):
    """A prompt (actor spec 4.5 plus DECISIONS 10). ``reply_to`` is the prompt stream.

    Bounds are the data plane's: ids and seeds are u64, counts u32, sampling floats
    finite float32 values (the begin record carries them)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    request_id: int = Field(
        description="The client's id of the prompt: 0 to 2^53 - 1, a JavaScript-safe integer"
    )
    prompt_text: str
    max_tokens: int | None = Field(default=None, ge=0, le=_U32)
    chat: bool = False
    messages: list[ChatMessage] | None = Field(
        default=None,
        max_length=1024,
        description=(
            "A whole conversation (with chat): rendered with the model's chat template on "
            "the head node, its control tokens encoded as such; prompt_text is then ignored"
        ),
    )
    temperature: float = Field(default=0.0, ge=0.0, le=1000.0)
    top_k: int = Field(default=0, ge=0, le=_U32)
    top_p: float = Field(default=1.0, ge=1e-6, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=_U64)
    stop: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "The client's stop strings (the gateway's): the run and the nodes do not act on "
            "them; they stay with the prompt so that a client re-attaching to it cuts the "
            "text where the original response was cut"
        ),
    )
    logprobs: bool = Field(
        default=False,
        description=(
            "Each generated token's log probability (the model's log-softmax over the whole "
            "vocabulary of the step's raw logits, before temperature and top-k/top-p) travels "
            "with the text deltas (TextDelta.logprobs)"
        ),
    )
    top_logprobs: int = Field(
        default=0,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="With logprobs: the most likely tokens of each step to report too (0-20)",
    )
    response_format: ResponseFormat | None = Field(
        default=None,
        description=(
            "The text must be JSON of this format (constrained decoding, DECISIONS 89); "
            "None: free text"
        ),
    )
    text_key: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{32}$",
        description=(
            "A key the client chose (32 lowercase hex digits, random) with which it reads "
            "this prompt's text straight from the head node without the deployment's edge "
            "secret (DECISIONS 80). It goes to the head node with the prompt; it opens that "
            "prompt's text only, which the prompt's own result holds too"
        ),
    )

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, value: int) -> int:
        problem = request_id_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> SubmitPrompt:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        return self


class TopLogprob(_Model):
    """One candidate token of a step: its text (its bytes as UTF-8, a broken character as
    U+FFFD), its bytes, and its log probability."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A generated token's log probability, and the step's ``top_logprobs`` most likely
    tokens (most likely first, ties by token id), as OpenAI's chat API shapes them."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list, max_length=MAX_TOP_LOGPROBS)


class TextDelta(_Model):
    type: Literal["text_delta"] = "text_delta"
    request_id: int
    text: str
    tokens: int | None = Field(
        default=None,
        ge=0,
        description="Generated tokens whose text this delta completes (None: a node that "
        "did not count them)",
    )
    prompt_tokens: int | None = Field(
        default=None,
        ge=0,
        description="On a prompt's first delta: its tokens as the head node encoded them",
    )
    cached_tokens: int | None = Field(
        default=None,
        ge=0,
        description="On a prompt's first delta: its prompt tokens the head stage took from "
        "its prefix cache instead of computing them (DECISIONS 91; None: a node that did "
        "not say)",
    )
    logprobs: list[TokenLogprob] | None = Field(
        default=None,
        description="A prompt that asked for logprobs: those of the tokens this delta "
        "completes, in order (None otherwise, or for tokens resumed after a stage recovery)",
    )


StopReason = Literal["eos", "max_tokens", "context"]


class Done(_Model):
    type: Literal["done"] = "done"
    request_id: int
    final_text: str
    tokens_generated: int
    elapsed_ms: int
    stop_reason: StopReason = Field(
        description="Why generation stopped: the model's end token, max_tokens, or the "
        "planned context (max_seq_len) filled up"
    )
    prompt_tokens: int | None = Field(
        default=None,
        ge=0,
        description="The prompt's tokens as the head node encoded them (None: a node that "
        "did not report them)",
    )
    cached_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Of those, the tokens the head stage took from its prefix cache "
        "(DECISIONS 91; None: a node that did not report them)",
    )
    recoveries: int = Field(
        default=0,
        ge=0,
        description="Stage recoveries the prompt went through (DECISIONS 68): each a pause, "
        "the text the same as an undisturbed run's",
    )


class Fault(_Model):
    type: Literal["fault"] = "fault"
    request_id: int
    error: str
    kind: ErrorType | None = Field(
        default=None,
        description="A prompt the head node refused, typed: PromptTooLong, "
        "ChatTemplateRefused or InvalidPrompt; None for any other end (a cancel, a fault)",
    )
    prompt_tokens: int | None = Field(
        default=None, ge=0, description="With PromptTooLong: the prompt's tokens"
    )
    text: str | None = Field(
        default=None,
        description="A run-hosted prompt stopped before its end (DECISIONS 66): the text it "
        "had generated, which no workflow stream holds",
    )
    tokens_generated: int | None = Field(
        default=None, ge=0, description="With text: the tokens the text holds"
    )


PromptTerminal = Annotated[Done | Fault, Field(discriminator="type")]
PromptEvent = Annotated[TextDelta | Done | Fault, Field(discriminator="type")]


class CancelPrompt(_Model):
    request_id: int


class ShutdownReason(StrEnum):
    OPERATOR_REQUESTED = "operator_requested"
    HOST_REQUESTED = "host_requested"
    PROMPT_SESSION_CLOSED = "prompt_session_closed"
    FATAL_DEPENDENCY = "fatal_dependency"
    ONE_SHOT_DONE = "one_shot_done"  # a one-shot run's prompt ended (actor spec 8)


class RequestShutdown(_Model):
    run_id: int | None = None
    reason: ShutdownReason = ShutdownReason.OPERATOR_REQUESTED
    reply_to: str | None = None


class GenerateInput(_Model):
    """The head node's generate activity input (one prompt)."""

    run_id: int
    readiness_id: str
    prompt_workflow_id: str
    prompt: SubmitPrompt
    max_new_tokens: int | None
    stream_batch_ms: int = 100
    # False: a run-hosted prompt (no workflow stream): its text goes to the head node's
    # direct readers only, and to Temporal with its terminal event (DECISIONS 66).
    temporal_text: bool = True
    # Stage recovery (DECISIONS 68): heartbeat the tokens so far (GenerateCheckpoint);
    # go on after ``resume``, the tokens generated on a head that was lost, with the text
    # from token ``text_from`` on (what the prompt's readers lack; None: after resume).
    checkpoint: bool = False
    resume: list[int] = Field(default_factory=list, max_length=1_048_576)
    text_from: int | None = Field(default=None, ge=0)


class StopGenerateInput(_Model):
    """A cancelled prompt's stop, pushed to its head node (DECISIONS 65)."""

    run_id: int
    readiness_id: str
    prompt_workflow_id: str


class PromptStatus(StrEnum):
    """How a prompt ended, as its workflow's result and search attribute show it."""

    DONE = "done"
    CANCELLED = "cancelled"
    FAULTED = "faulted"


class PromptTiming(_Model):
    """Where a prompt's time went on its head node (milliseconds, the node's clock).

    The time to first token is the prompt's wait in the run's queue (the prompt workflow
    measures it) + ``encode_ms`` + ``prefill_ms`` + ``first_delta_ms``."""

    encode_ms: float = Field(ge=0, description="Tokenize the prompt")
    prefill_ms: float = Field(ge=0, description="Encode end to the first token sampled")
    first_delta_ms: float = Field(
        ge=0,
        description="First token to its text published on the prompt's stream (after an "
        "early start: the wait for its admission too)",
    )
    decode_tokens_per_s: float | None = Field(
        default=None, ge=0, description="Tokens after the first over the time they took"
    )
    early_ms: float | None = Field(
        default=None,
        ge=0,
        description="How long before its generate the head started it (an early start, "
        "DECISIONS 103: its encode and prefill then overlap its admission)",
    )


class PromptOutcome(_Model):
    """What a prompt workflow returns: the terminal event, and a run fault if any."""

    terminal: PromptTerminal
    run_fault: str | None = None
    status: PromptStatus = PromptStatus.DONE
    timing: PromptTiming | None = None
    # Set by the prompt workflow: admission (its start) to activation, workflow time.
    queued_ms: float | None = Field(default=None, ge=0)


class ServedPrompt(_Model):
    """A run-hosted prompt that ended (DECISIONS 66): kept by its run, a bounded number of
    them, so that a client can re-attach after its end and the dashboard read its figures."""

    workflow_id: str  # the prompt's key: the id its PromptWorkflow would have had
    outcome: PromptOutcome
    admitted_ms: int  # epoch ms, workflow time: the Update admitted it
    stop: list[str] = Field(default_factory=list)  # its stop strings (a re-attach cuts there)


class PromptAdmitted(_Model):
    """The ``admit_prompt`` Update's result (DECISIONS 77): the run has admitted the
    prompt, and the Update is over; the prompt is served on without it. Its end is the
    child PromptWorkflow's result, or, for a run-hosted prompt, the ``prompt_end``
    query's answer."""

    request_id: int
    prompt_id: str = Field(
        description="The prompt's key: its PromptWorkflow's id, or the id it would have had "
        "(a run-hosted prompt): its text stream, its end and a re-attach are keyed by it"
    )
    hosted: bool = Field(description="Served by the run itself (prompt_host run)")


class PromptAdmission(_Model):
    """One prompt of an ``admit_prompts`` Update (DECISIONS 106) and the key its client
    chose for it: the prompt's id is made of it as ``admit_prompt``'s is of its Update's
    id (names.update_key), so that the client knows it before the run answers."""

    prompt: SubmitPrompt
    key: str = Field(min_length=1, max_length=64)


class PromptAdmissions(_Model):
    """The ``admit_prompts`` Update's input: prompts admitted in this order, each on its
    own (one refused leaves the others as they would be alone)."""

    items: list[PromptAdmission] = Field(min_length=1, max_length=names.ADMISSIONS_PER_UPDATE)


class AdmissionAnswer(_Model):
    """What the run said to one prompt of an ``admit_prompts`` Update: admitted, or refused
    with the type and message ``admit_prompt``'s validator would have raised."""

    admitted: PromptAdmitted | None = None
    refused_type: str | None = None
    refused: str | None = None


class AdmissionAnswers(_Model):
    """The ``admit_prompts`` Update's result: an answer for each prompt, in its order."""

    answers: list[AdmissionAnswer]


class PromptEnd(_Model):
    """The ``prompt_end`` query's answer for one prompt: still open (queued or generating)
    or ended and counted by the run; a run-hosted prompt's end with its one terminal
    event, as the run keeps it (a PromptWorkflow's terminal event is that workflow's
    result)."""

    prompt_id: str
    open: bool
    terminal: PromptTerminal | None = None


class PromptInput(_Model):
    run_id: int
    readiness_id: str
    prompt: SubmitPrompt
    max_new_tokens: int | None
    head_task_queue: str
    head_node_id: int | None = None  # for the Web UI's activity summary only
    generate_heartbeat_s: float = 30.0
    stream_batch_ms: int = 100
    # Next in line at admission: generate at once, without waiting for activation.
    start_active: bool = False
    # Stage recovery (DECISIONS 68): a prompt whose head node is lost goes on, on the
    # replacement head, from its last checkpoint, for at most recovery_wait_s.
    on_node_loss: NodeLossPolicy = NodeLossPolicy.FAIL
    recovery_wait_s: float = Field(default=300.0, gt=0, le=_DAY_S)


class PromptHead(_Model):
    """The run to its prompts, in a stage recovery of the head (DECISIONS 68): the head
    node is lost (``ready`` False), or its replacement serves (``ready`` True)."""

    node_id: int
    task_queue: str
    readiness_id: str
    ready: bool


class GenerateCheckpoint(_Model):
    """A generate's heartbeat details where the run replaces lost nodes (DECISIONS 68):
    the tokens the prompt has generated so far, to go on from should its head be lost."""

    tokens: list[int] = Field(default_factory=list, max_length=1_048_576)
