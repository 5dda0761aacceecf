"""The head node tokenizes once and reports what the gateway needs (issue 21): the
prompt's token count, the tokens behind each piece of text, and a typed refusal of a
prompt it cannot serve (too long, a chat template that refuses it). The real bundled
model in direct mode; tests/integration/test_gateway.py drives the same through a run.

With ``max_active_prompts`` above 1 the stage serves prompts side by side (scheduler.py,
DECISIONS 62): each prompt's text is its text alone, whatever runs beside it, and a
cancelled one ends at its next step while the others go on."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from mvp_core.errors import ErrorType
from mvp_core.generation import PromptRefused
from mvp_core.models import (
    ChatMessage,
    EngineSettings,
    LayerRange,
    StageProvision,
    SubmitPrompt,
    TokenLogprob,
)
from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled
from workers.node.engine import SamplingParams, generate
from workers.node.runtime import GenerationResult, StageRuntime

CONTEXT = 64
SLOTS = 4
TEXTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def runtime() -> Iterator[StageRuntime]:
    path = str(fetch_bundled(DEFAULT_BUNDLED))
    provision = StageProvision(
        run_id=1,
        authorized_orchestrator="test",
        node_id=1,
        stage_index=0,
        stage_count=1,
        layers=LayerRange(start=0, end=30),
        inbound_edge=None,
        outbound_edge=None,
        consumer_endpoint=None,
        model_name="smollm",
        model_path=path,
        tokenizer_path=path,
        max_seq_len=CONTEXT,
        max_active_prompts=SLOTS,
        readiness_id="r",
        engine=EngineSettings(device="cpu", threads=1, compute_cpus="off", token_path_nice=None),
        run_workflow_id="mvp-run-1",
    )
    rt = StageRuntime.load(provision)
    yield rt
    rt.close()


def test_a_generation_reports_the_prompts_tokens_and_the_tokens_behind_its_text(runtime):
    prompt = SubmitPrompt(request_id=1, prompt_text="The capital of France is")
    counted: list[int] = []
    pieces: list[tuple[str, int]] = []
    result = runtime.run(
        prompt, 6, lambda text, n: pieces.append((text, n)), lambda: False, counted.append
    )
    n_prompt = len(runtime.tokenizer.encode(prompt.prompt_text))
    assert counted == [n_prompt] and result.prompt_tokens == n_prompt
    assert result.tokens == 6 and "".join(t for t, _ in pieces) == result.text
    counts = [n for _, n in pieces]
    assert counts == sorted(counts) and counts[-1] == result.tokens


def test_a_prompt_past_the_context_is_refused_typed_with_its_count(runtime):
    text = "one two three four five six seven eight nine ten " * 10
    n = len(runtime.tokenizer.encode(text))
    assert n >= CONTEXT
    with pytest.raises(PromptRefused) as err:
        runtime.encode(SubmitPrompt(request_id=1, prompt_text=text))
    assert err.value.kind is ErrorType.PROMPT_TOO_LONG and err.value.prompt_tokens == n
    assert f"prompt has {n} tokens; the planned context holds {CONTEXT}" in str(err.value)


def test_a_chat_template_that_refuses_the_conversation_is_a_typed_refusal(
    runtime, monkeypatch: pytest.MonkeyPatch
):
    chat = SubmitPrompt(
        request_id=1,
        prompt_text="",
        chat=True,
        messages=[ChatMessage(role="user", content="a"), ChatMessage(role="user", content="b")],
    )
    assert runtime.encode(chat)  # SmolLM2's own template takes it
    tok = runtime.tokenizer
    monkeypatch.setattr(
        tok, "chat_template", "{{ raise_exception('Conversation roles must alternate') }}"
    )
    with pytest.raises(PromptRefused) as err:
        runtime.encode(chat)
    assert err.value.kind is ErrorType.CHAT_TEMPLATE_REFUSED
    assert "chat template refused the messages: Conversation roles must alternate" in str(err.value)
    monkeypatch.setattr(tok, "chat_template", None)
    monkeypatch.setattr(tok, "has_chat_template", False)
    with pytest.raises(PromptRefused, match="the model has no chat template") as err:
        runtime.encode(chat)
    assert err.value.kind is ErrorType.CHAT_TEMPLATE_REFUSED


def _run(
    runtime: StageRuntime,
    request_id: int,
    text: str,
    max_new: int | None,
    *,
    seed: int | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    on_piece: Callable[[str, int], None] = lambda t, n: None,
    resume: Sequence[int] = (),
) -> GenerationResult:
    prompt = SubmitPrompt(
        request_id=request_id,
        prompt_text=text,
        temperature=0.0 if seed is None else 0.9,
        top_k=40,
        top_p=0.95,
        seed=seed,
    )
    return runtime.run(prompt, max_new, on_piece, should_stop, resume=resume)


def _at_once(runtime: StageRuntime, jobs: list[Callable[[], GenerationResult]]) -> list[object]:
    """Run ``jobs`` in threads released together; each one's result (or what it raised)."""
    out: list[object] = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def work(i: int) -> None:
        start.wait()
        try:
            out[i] = jobs[i]()
        except BaseException as err:
            out[i] = err

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_prompts_side_by_side_give_each_prompts_text_alone(runtime, seeded):
    def seed(i: int) -> int | None:
        return 7 + i if seeded else None

    alone = [_run(runtime, i, t, 12, seed=seed(i)) for i, t in enumerate(TEXTS)]
    together = _at_once(
        runtime,
        [lambda i=i, t=t: _run(runtime, i, t, 12, seed=seed(i)) for i, t in enumerate(TEXTS)],
    )
    for a, b in zip(alone, together, strict=True):
        assert isinstance(b, GenerationResult), b
        assert (b.text, b.tokens, b.stop_reason) == (a.text, a.tokens, a.stop_reason)
    assert runtime.scheduler is not None and runtime.scheduler.active == 0


def test_a_cancelled_prompt_ends_at_its_next_step_and_the_others_finish(runtime):
    alone = [_run(runtime, i, t, 24) for i, t in enumerate(TEXTS[1:])]
    cancel = threading.Event()

    def first_piece(text: str, n: int) -> None:
        cancel.set()  # the victim's first text: cancel it now

    jobs = [
        lambda: _run(runtime, 9, TEXTS[0], None, should_stop=cancel.is_set, on_piece=first_piece),
        *[lambda i=i, t=t: _run(runtime, i, t, 24) for i, t in enumerate(TEXTS[1:])],
    ]
    victim, *others = _at_once(runtime, jobs)
    assert isinstance(victim, GenerationResult) and victim.stop_reason == "cancelled"
    assert victim.tokens < CONTEXT // 2  # long before the context's end
    for a, b in zip(alone, others, strict=True):
        assert isinstance(b, GenerationResult) and b.text == a.text and b.tokens == 24


@pytest.mark.parametrize("seed", [None, 11])
def test_a_resumed_prompt_gives_the_undisturbed_text_and_streams_only_what_is_new(runtime, seed):
    """Stage recovery (issue 23), on the head's runtime: a prompt run again with the
    tokens it had goes on as if undisturbed; the result holds the whole text and count,
    and its text stream only what its reader has not had."""
    text = "Once upon a time"
    whole = _run(runtime, 1, text, 24, seed=seed)
    assert len(whole.token_ids) == whole.tokens == 24
    k = 9
    pieces: list[tuple[str, int]] = []
    resumed = _run(runtime, 2, text, 24, seed=seed, resume=whole.token_ids[:k],
                   on_piece=lambda t, n: pieces.append((t, n)))  # fmt: skip
    assert (resumed.text, resumed.tokens, resumed.token_ids) == (
        whole.text, whole.tokens, whole.token_ids,
    )  # fmt: skip
    streamed = "".join(t for t, _ in pieces)
    assert streamed and whole.text.endswith(streamed) and len(streamed) < len(whole.text)
    assert pieces[0][1] > k and pieces[-1][1] == 24


def test_logprobs_side_by_side_are_each_prompts_alone_with_their_tokens_texts(runtime):
    """Direct mode (the scheduler's batch): a prompt that asks for logprobs gets one entry
    per generated token, its text the token's own (together the prompt's text), the same
    alone and beside the others; greedy, its logprob is the first of its step's top."""

    def run(i: int, text: str) -> tuple[GenerationResult, list[TokenLogprob | None]]:
        prompt = SubmitPrompt(request_id=i, prompt_text=text, logprobs=True, top_logprobs=4)
        got: list[TokenLogprob | None] = []
        return runtime.run(prompt, 6, lambda t, n: None, lambda: False, logprobs=got), got

    alone = [run(i, t) for i, t in enumerate(TEXTS)]
    together = _at_once(runtime, [lambda i=i, t=t: run(i, t) for i, t in enumerate(TEXTS)])
    for (result, entries), b in zip(alone, together, strict=True):
        assert isinstance(b, tuple), b
        assert (b[0].text, b[1]) == (result.text, entries)
        assert len(entries) == result.tokens == 6
        assert "".join(e.token for e in entries if e is not None) == result.text
        for e in entries:
            assert e is not None and len(e.top_logprobs) == 4
            assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    # Not asked: nothing.
    none: list[TokenLogprob | None] = []
    runtime.run(SubmitPrompt(request_id=9, prompt_text=TEXTS[0]), 2, lambda t, n: None,
                lambda: False, logprobs=none)  # fmt: skip
    assert none == []


def test_a_response_format_in_direct_mode_gives_json_of_it_beside_free_prompts(runtime):
    """Direct mode (the scheduler's batch, DECISIONS 89): the stage's vocabulary masks a
    prompt with a format to JSON of its schema; the free prompts beside it keep their
    texts."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": schema}

    def run(i: int, text: str, with_format: bool) -> GenerationResult:
        extra = {"response_format": fmt} if with_format else {}
        prompt = SubmitPrompt(request_id=i, prompt_text=text, **extra)
        return runtime.run(prompt, 40, lambda t, n: None, lambda: False)

    alone = run(9, "A JSON object:", True)
    value = json.loads(alone.text)
    assert alone.stop_reason == "eos" and set(value) == {"name", "ok"}, alone.text
    free = [run(i, t, False).text for i, t in enumerate(TEXTS)]
    together = _at_once(
        runtime,
        [lambda: run(9, "A JSON object:", True)]
        + [lambda i=i, t=t: run(i, t, False) for i, t in enumerate(TEXTS)],
    )
    assert [r.text for r in together if isinstance(r, GenerationResult)] == [alone.text, *free]


def test_a_prompt_that_starts_as_a_recent_one_reports_its_cached_tokens(runtime):
    """DECISIONS 91: the stage keeps the whole 16-token blocks of a prompt it ran; the next
    prompt that starts the same way takes them from the cache (at least 8 of its tokens
    still computed) and says how many, with the text it has without them."""
    shared = "one two three four five six seven eight nine ten " * 3  # 30 words
    first = SubmitPrompt(request_id=21, prompt_text=shared + "What comes next? Eleven")
    second = SubmitPrompt(request_id=22, prompt_text=shared + "And after ten? It is eleven")
    told: list[int] = []
    a = runtime.run(first, 4, lambda t, n: None, lambda: False, on_cached=told.append)
    assert runtime.scheduler is not None
    if runtime.scheduler.prefix is None:
        pytest.skip("this CPU runs the torch kernels, which keep no prefixes")
    b = runtime.run(second, 4, lambda t, n: None, lambda: False, on_cached=told.append)
    ids, before = runtime.encode(second), runtime.encode(first)
    common = next(i for i, (x, y) in enumerate(zip(ids, before, strict=False)) if x != y)
    want = min(common, len(ids) - 8) // 16 * 16
    assert want >= 16
    assert (a.cached_tokens, b.cached_tokens) == (0, want) and told == [0, want]
    alone = generate([runtime.stage], ids, max_new_tokens=4, max_seq_len=CONTEXT,
                     sampling=SamplingParams(), stop_ids=runtime.stop_ids)  # fmt: skip
    assert b.token_ids == list(alone)
    assert runtime.scheduler.prefix.stats.reused_tokens == want
