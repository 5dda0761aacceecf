"""Fuzzing request validation: a typed rejection that names fields, never echoes values.

Arbitrary JSON and RunRequest-/SubmitPrompt-shaped dicts with wrong types and values go
through `parse_request` + `validate_request` and `SubmitPrompt.model_validate` +
`describe_invalid`. The outcome is either a valid model or the module's typed error
(RunRejectedError, pydantic's ValidationError) whose message names the broken fields;
nothing else is ever raised. Every string value the fuzz puts in carries a marker
(``Zq<8 hex>Xv``), and no message may contain one: values can be near-secrets
(node_env) or private user text (prompt_text).

Hypothesis runs derandomized and without an example database (CI tries the same cases
every time); each test prints how many cases it ran (`pytest -s` shows it).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mvp_core.models import RunRequest, SubmitPrompt
from mvp_core.validation import RunRejectedError, describe_invalid, parse_request, validate_request

FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=True,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_MARKER_RE = re.compile(r"Zq[0-9a-f]{8}Xv")


def _report(name: str, cases: int, started: float, kinds: Counter[str]) -> None:
    detail = ", ".join(f"{k}={v}" for k, v in sorted(kinds.items()))
    print(f"\n[fuzz] {name}: {cases} cases in {time.monotonic() - started:.2f} s ({detail})")


def _assert_no_marker(message: str) -> None:
    leaked = _MARKER_RE.findall(message)
    assert not leaked, f"values echoed in the message: {leaked}: {message}"


# --------------------------------------------------------------------------- strategies

_marker = st.builds(
    lambda n, pre, post: f"{pre}Zq{n:08x}Xv{post}",
    st.integers(0, 0xFFFF_FFFF),
    st.text(max_size=4),
    st.text(max_size=4),
)

_RUN_FIELDS = sorted(RunRequest.model_fields)
_PROMPT_FIELDS = sorted(SubmitPrompt.model_fields)
_NESTED_FIELDS = ["bundled", "path", "readiness_s", "ack_s", "precision", "compute_cpus"]
_keys = st.one_of(
    st.sampled_from(_RUN_FIELDS + _PROMPT_FIELDS + _NESTED_FIELDS), st.text(max_size=8)
)

# Every string leaf is a marker: whatever the validators echo of a value shows.
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), _marker),
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(_keys, kids, max_size=4)),
    max_leaves=24,
)
_json_objects = st.one_of(
    st.dictionaries(_keys, _json, max_size=6),
    st.dictionaries(st.sampled_from(_RUN_FIELDS + _PROMPT_FIELDS), _json, max_size=6),
)

_not_int = st.one_of(
    _marker,
    st.floats(allow_nan=True).filter(lambda f: not (math.isfinite(f) and f == int(f))),
    st.lists(_json, max_size=2),
    st.dictionaries(st.sampled_from(["a", "b"]), _json, max_size=2),
)
_negative = st.integers(max_value=-1)
_not_str = st.one_of(
    st.integers(), st.floats(), st.lists(_marker, max_size=2), st.dictionaries(_keys, _marker)
)
_not_float = st.one_of(
    _marker, st.lists(_json, max_size=2), st.dictionaries(st.just("x"), _marker, max_size=1)
)


def _sub(key: str, value: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return value.map(lambda v: {key: v})


def _image_goes_with_docker(run: dict[str, Any]) -> dict[str, Any]:
    """A worker image is a Docker run's (a process run refuses one): a valid request that
    names one runs on Docker."""
    if run.get("worker_image") is not None:
        return {**run, "provider": "docker"}
    return run


# A valid RunRequest whose every string is a marker.
_valid_source = st.one_of(
    _marker.map(lambda m: {"bundled": m}),
    _marker.map(lambda m: {"path": m}),
    st.tuples(_marker, st.none()).map(lambda t: {"bundled": t[0], "path": t[1]}),
)
_valid_run = st.fixed_dictionaries(
    {"model": _valid_source},
    optional={
        "run_id": st.none() | st.integers(0, 2**63),
        "orchestrator_node_id": st.integers(0, 99),
        "node_id": st.integers(0, 99),
        "provider": st.sampled_from(["process", "docker"]),
        "worker_image": st.none()
        | st.integers(0, 0xFFFF_FFFF).map(lambda n: f"registry.local/zq{n:08x}xv:1"),
        "tokenizer": st.none() | _valid_source,
        "pipeline_stages": st.integers(1, 8),
        "default_max_tokens": st.none() | st.integers(0, 4096),
        "max_context": st.none() | st.integers(1, 8192),
        "prompt_queue_capacity": st.integers(1, 8),
        "stream_batch_ms": st.integers(25, 10_000),
        "timeouts": st.fixed_dictionaries(
            {}, optional={"readiness_s": st.floats(0.5, 600), "stop_grace_s": st.floats(0, 60)}
        ),
        "engine": st.fixed_dictionaries(
            {},
            optional={
                "precision": st.sampled_from(["default", "float32"]),
                "threads": st.none() | st.integers(1, 16),
                "compute_cpus": st.sampled_from(["auto", "off", [], [0, 1]]),
                "token_path_nice": st.none() | st.integers(-20, 19),
            },
        ),
        "node_env": st.dictionaries(st.sampled_from(["VAR_A", "LOG_LEVEL", "HF_HOME"]), _marker),
    },
).map(_image_goes_with_docker)

# field -> (level, expected fragment of the message, strategy of the wrong value).
# "parse": pydantic rejects it (the message names the path); "validate": it parses and
# validate_request rejects it (the message names the field, once, for the first problem).
_RUN_MUTATIONS: dict[str, list[tuple[str, str, st.SearchStrategy[Any]]]] = {
    "run_id": [("parse", "run_id", _negative | _not_int)],
    "orchestrator_node_id": [("parse", "orchestrator_node_id", _negative | _not_int | st.none())],
    "node_id": [("parse", "node_id", _negative | _not_int | st.none())],
    "provider": [
        ("parse", "provider", _marker | st.integers() | st.none() | st.lists(_marker)),
        ("validate", "provider", st.just("vastai")),
    ],
    "worker_image": [
        ("parse", "worker_image", _not_str),
        ("validate", "worker_image", _marker.map(lambda m: f"bad image {m}")),
    ],
    "model": [
        ("parse", "model", _marker | st.integers() | st.lists(_marker, max_size=2)),
        ("parse", "model.bundled", _sub("bundled", _not_str)),
        ("parse", "model.path", _sub("path", _not_str)),
        (
            "parse",
            "model.surplus",
            st.tuples(_marker, _marker).map(lambda t: {"bundled": t[0], "surplus": t[1]}),
        ),
        (
            "validate",
            "exactly one of model.bundled, model.path or model.hf",
            st.sampled_from([{}, {"path": None}]),
        ),
        (
            "validate",
            "exactly one of model.bundled, model.path or model.hf",
            st.tuples(_marker, _marker).map(lambda t: {"bundled": t[0], "path": t[1]}),
        ),
    ],
    "tokenizer": [
        ("parse", "tokenizer", _marker | st.integers() | st.lists(_marker, max_size=2)),
        ("parse", "tokenizer.path", _sub("path", _not_str)),
        ("validate", "tokenizer", st.just({})),
        (
            "validate",
            "tokenizer",
            st.tuples(_marker, _marker).map(lambda t: {"bundled": t[0], "path": t[1]}),
        ),
    ],
    "pipeline_stages": [
        ("parse", "pipeline_stages", _not_int | st.none()),
        ("validate", "pipeline-stages", st.integers(max_value=0)),
    ],
    "default_max_tokens": [("parse", "default_max_tokens", _negative | _not_int)],
    "max_context": [("parse", "max_context", st.integers(max_value=0) | _not_int)],
    "prompt_queue_capacity": [
        ("parse", "prompt_queue_capacity", _not_int | st.none()),
        ("validate", "prompt_queue_capacity", st.integers(max_value=0) | st.integers(min_value=9)),
    ],
    "stream_batch_ms": [
        ("parse", "stream_batch_ms", st.integers(max_value=24) | st.integers(min_value=10_001)),
        ("parse", "stream_batch_ms", _not_int | st.none()),
    ],
    "timeouts": [
        ("parse", "timeouts", _marker | st.integers() | st.lists(_json, max_size=2)),
        ("parse", "timeouts.readiness_s", _sub("readiness_s", st.floats(max_value=0.0))),
        ("parse", "timeouts.readiness_s", _sub("readiness_s", st.just(math.nan))),
        ("parse", "timeouts.ack_s", _sub("ack_s", _not_float | st.none())),
        ("parse", "timeouts.stop_grace_s", _sub("stop_grace_s", st.floats(max_value=-1e-9))),
        ("parse", "timeouts.surplus", _sub("surplus", _marker)),
    ],
    "engine": [
        ("parse", "engine", _marker | st.integers() | st.lists(_json, max_size=2)),
        ("parse", "engine.precision", _sub("precision", _marker | st.integers())),
        ("parse", "engine.device", _sub("device", _marker | st.none())),
        ("parse", "engine.address_layout", _sub("address_layout", _marker)),
        ("parse", "engine.threads", _sub("threads", st.integers(max_value=0) | _not_int)),
        (
            "parse",
            "engine.fp16_split_points",
            _sub("fp16_split_points", _marker | st.lists(_marker, min_size=1, max_size=3)),
        ),
        (
            "parse",
            "engine.compute_cpus",
            _sub(
                "compute_cpus",
                _marker | st.integers() | st.lists(_negative | _marker, min_size=1, max_size=3),
            ),
        ),
        (
            "parse",
            "engine.token_path_nice",
            _sub(
                "token_path_nice", st.integers(max_value=-21) | st.integers(min_value=20) | _marker
            ),
        ),
    ],
    "node_env": [
        ("parse", "node_env", _marker | st.integers() | st.lists(_marker, max_size=2)),
        ("parse", "node_env.VAR_B", _sub("VAR_B", _not_str | st.none())),
        (
            "validate",
            "node_env",
            st.tuples(
                st.sampled_from(
                    ["API_KEY", "hf_token", "MY_SECRET", "DB_PASSWORD", "MVP_FAULT_X", "MVP_PORT"]
                ),
                _marker,
            ).map(lambda t: {t[0]: t[1]}),
        ),
    ],
    "surplus_field": [("parse", "surplus_field", _json)],
}


_VALIDATE_FIELDS = sorted(
    f for f, options in _RUN_MUTATIONS.items() if any(m[0] == "validate" for m in options)
)


@st.composite
def _run_case(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """A valid request with 0..3 fields made wrong: (request, [(field, level, fragment)])."""
    raw = dict(draw(_valid_run))
    mode = draw(st.sampled_from(["mixed", "mixed", "validate_only", "none"]))
    names = _VALIDATE_FIELDS if mode == "validate_only" else sorted(_RUN_MUTATIONS)
    fields = (
        []
        if mode == "none"
        else draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    )
    applied = []
    for field in fields:
        options = _RUN_MUTATIONS[field]
        if mode == "validate_only":
            options = [m for m in options if m[0] == "validate"]
        level, fragment, wrong = draw(st.sampled_from(options))
        raw[field] = draw(wrong)
        applied.append((field, level, fragment))
    return raw, applied


# --------------------------------------------------------------------------- run requests


def _check_run_request(raw: Any) -> tuple[str, str]:
    """Returns (outcome, message); anything but RunRejectedError propagates and fails."""
    try:
        request = parse_request(raw)
    except RunRejectedError as e:
        msg = str(e)
        assert msg.startswith("invalid run request: "), msg
        _assert_no_marker(msg)
        return "parse_rejected", msg
    assert isinstance(request, RunRequest)
    try:
        validate_request(request)
    except RunRejectedError as e:
        msg = str(e)
        _assert_no_marker(msg)
        return "validate_rejected", msg
    return "valid", ""


def test_run_request_arbitrary_json() -> None:
    kinds: Counter[str] = Counter()

    @settings(FUZZ, max_examples=600)
    @given(st.one_of(_json, _json_objects))
    def case(raw: Any) -> None:
        outcome, msg = _check_run_request(raw)
        kinds[outcome] += 1
        if not isinstance(raw, dict):
            assert msg.startswith("invalid run request: expected a JSON object, got "), msg
            return
        # Every unknown top-level key is named (by its name: a key is not a value), up to
        # the message's bound ("and N more").
        for key in raw:
            if key and key not in RunRequest.model_fields:
                assert outcome == "parse_rejected", (key, msg)
                assert f"{key[:80]}: Extra inputs" in msg or _cut(msg), (key, msg)

    started = time.monotonic()
    case()
    _report("run request, arbitrary JSON", sum(kinds.values()), started, kinds)


def _cut(msg: str) -> bool:
    """The message named the first fields and counted the rest (mvp_core.validation)."""
    return msg.endswith(" more")


def test_run_request_wrong_fields() -> None:
    kinds: Counter[str] = Counter()

    @settings(FUZZ, max_examples=600)
    @given(_run_case())
    def case(c: tuple[dict[str, Any], list[tuple[str, str, str]]]) -> None:
        raw, applied = c
        outcome, msg = _check_run_request(raw)
        kinds[outcome] += 1
        parse_level = [frag for _f, level, frag in applied if level == "parse"]
        validate_level = [frag for _f, level, frag in applied if level == "validate"]
        if parse_level:
            assert outcome == "parse_rejected", (raw, applied, outcome)
            for fragment in parse_level:  # every broken field, up to the message's bound
                assert fragment in msg or _cut(msg), (fragment, msg)
        elif validate_level:
            assert outcome == "validate_rejected", (raw, applied, outcome)
            assert any(fragment in msg for fragment in validate_level), (validate_level, msg)
        else:
            assert outcome == "valid", (raw, msg)

    started = time.monotonic()
    case()
    _report("run request, wrong fields", sum(kinds.values()), started, kinds)
    assert {"parse_rejected", "validate_rejected", "valid"} <= set(kinds)


# --------------------------------------------------------------------------- prompts

_valid_prompt = st.fixed_dictionaries(
    {"request_id": st.integers(0, 2**53 - 1), "prompt_text": _marker},
    optional={
        "max_tokens": st.none() | st.integers(0, 4096),
        "chat": st.booleans(),
        "temperature": st.floats(0.0, 2.0),
        "top_k": st.integers(0, 100),
        "top_p": st.floats(1e-6, 1.0),
        "seed": st.none() | st.integers(0, 2**63),
    },
)
_MISSING = object()
_PROMPT_MUTATIONS: dict[str, st.SearchStrategy[Any]] = {
    "request_id": _negative | _not_int | st.none() | st.just(_MISSING),
    "prompt_text": _not_str | st.none() | st.just(_MISSING),
    "max_tokens": _negative | _not_int,
    "chat": st.one_of(
        _marker, st.integers().filter(lambda i: i not in (0, 1)), st.lists(_marker), st.none()
    ),
    "temperature": st.floats(max_value=-1e-12)
    | st.floats(min_value=1000.0, exclude_min=True)
    | st.just(math.nan)
    | st.just(math.inf)
    | _not_float
    | st.none(),
    "top_k": _negative | _not_int | st.none() | st.integers(min_value=2**32),
    "top_p": st.one_of(
        st.floats(max_value=1e-6, exclude_max=True),
        st.floats(min_value=1.0, exclude_min=True),
        st.just(math.nan),
        _not_float,
    ),
    "seed": _negative | _not_int | st.integers(min_value=2**64),
    "surplus": _json,
}


@st.composite
def _prompt_case(draw: st.DrawFn) -> tuple[dict[str, Any], list[str]]:
    raw = dict(draw(_valid_prompt))
    fields = draw(
        st.lists(st.sampled_from(sorted(_PROMPT_MUTATIONS)), min_size=1, max_size=3, unique=True)
        if draw(st.sampled_from([True, True, True, False]))
        else st.just([])
    )
    for field in fields:
        value = draw(_PROMPT_MUTATIONS[field])
        if value is _MISSING:
            raw.pop(field, None)
        else:
            raw[field] = value
    return raw, fields


def _check_prompt(raw: Any) -> tuple[SubmitPrompt | None, str]:
    try:
        return SubmitPrompt.model_validate(raw), ""
    except ValidationError as err:
        msg = describe_invalid(err)
        assert msg, "an empty description"
        _assert_no_marker(msg)
        return None, msg


def test_submit_prompt_fuzz() -> None:
    kinds: Counter[str] = Counter()

    @settings(FUZZ, max_examples=600)
    @given(st.one_of(_prompt_case(), st.one_of(_json, _json_objects).map(lambda j: (j, None))))
    def case(c: tuple[Any, list[str] | None]) -> None:
        raw, broken = c
        prompt, msg = _check_prompt(raw)
        if broken is None:  # arbitrary JSON: valid or a described ValidationError
            kinds["json_" + ("valid" if prompt else "rejected")] += 1
            return
        kinds["shaped_" + ("valid" if prompt else "rejected")] += 1
        if not broken:
            assert prompt is not None and prompt.prompt_text == raw["prompt_text"], msg
            return
        assert prompt is None, (raw, broken)
        for field in broken:
            assert f"{field}: " in msg or _cut(msg), (field, msg)
        # The paths are the message's: "field: why; field: why", never a value.
        for part in msg.split("; "):
            if part.startswith("and ") and part.endswith(" more"):
                continue
            path = part.split(": ", 1)[0]
            assert path.split(".")[0] in [*_PROMPT_FIELDS, "surplus"], (path, msg)

    started = time.monotonic()
    case()
    _report("submit prompt", sum(kinds.values()), started, kinds)
    assert {"shaped_valid", "shaped_rejected", "json_rejected"} <= set(kinds)
