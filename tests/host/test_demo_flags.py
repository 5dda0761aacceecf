"""Every flag of ``python -m workers.host.demo`` is checked before anything starts (issue
38 item 12): a refused value is named as the user typed it, with its reason, the way
argparse refuses its own (the usage line, ``...: error: ...``, exit status 2), and no data
directory, dev server, worker or run was made for it.

The checks run in this process (``demo.run``), with everything the demo would start
replaced by a tripwire; one test runs the module itself, as a user does."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests.helpers.hub_standin import tiny_gguf
from workers.host import demo
from workers.host.demo_args import check_flags

REPO = Path(__file__).resolve().parents[2]
USAGE = "usage: python -m workers.host.demo"
ERROR = "python -m workers.host.demo: error: "


class Started(AssertionError):
    """The demo went on to start something it should not have."""


@pytest.fixture
def tripwires(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What the demo starts, each failing the test if it is reached; the process's
    SIGTERM handler and the demo's log handlers restored after (demo.run sets both)."""

    def started(what: str) -> Any:
        def trip(*_: Any, **__: Any) -> Any:
            raise Started(f"the demo started {what}")

        return trip

    monkeypatch.setattr(demo, "start_dev_server", started("a dev server"))
    monkeypatch.setattr(demo, "start_worker", started("an orchestrator worker"))
    monkeypatch.setattr(demo.RunHandle, "start", started("a run"))
    monkeypatch.setattr(demo.asyncio, "run", started("its event loop"))
    sigterm = signal.getsignal(signal.SIGTERM)
    handlers = list(demo.log.handlers)
    yield
    signal.signal(signal.SIGTERM, sigterm)
    for handler in demo.log.handlers:
        if handler not in handlers:
            demo.log.removeHandler(handler)
            handler.close()


def refused(capsys: pytest.CaptureFixture[str], data_dir: Path, *argv: str) -> str:
    """The demo run with ``argv``: it exits with 2 and says why on stderr, argparse's way;
    that line without its prefix."""
    code = demo.run(demo.parser().parse_args(["--data-dir", str(data_dir), *argv]))
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert out == "", out  # nothing began: no "starting Temporal dev server"
    lines = err.splitlines()
    assert lines[0].startswith(USAGE), err
    assert lines[-1].startswith(ERROR), err
    return lines[-1].removeprefix(ERROR)


# --------------------------------------------------------------------------- each class


@pytest.mark.usefixtures("tripwires")
def test_zero_stages_is_refused_as_stages(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    data_dir = tmp_path / "demo"
    why = refused(capsys, data_dir, "--stages", "0")
    assert why == (
        "--stages 0: a run needs 1 stage or more (1: direct mode, one node holding every layer)"
    )
    assert "pipeline-stages" not in why  # the demo's flag, not another command's
    assert not data_dir.exists()  # checked before the data directory is made


@pytest.mark.usefixtures("tripwires")
def test_negative_max_tokens_is_refused_as_max_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    why = refused(capsys, tmp_path / "demo", "--max-tokens", "-1")
    # Both the run's default_max_tokens and the prompt's max_tokens: one line, the flag's.
    assert why == "--max-tokens -1: Input should be greater than or equal to 0"
    why = refused(capsys, tmp_path / "demo", "--max-tokens", str(2**32))
    assert why == "--max-tokens 4294967296: Input should be less than or equal to 4294967295"
    assert not (tmp_path / "demo").exists()


@pytest.mark.usefixtures("tripwires")
def test_empty_prompt_is_refused_as_prompt(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    why = refused(capsys, tmp_path / "demo", "--prompt", "")
    assert why == "--prompt '': the prompt must not be empty (the run refuses an empty prompt)"
    assert "InvalidPrompt" not in why


@pytest.mark.usefixtures("tripwires")
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--max-active-prompts", "0"], "--max-active-prompts 0: Input should be greater than"),
        (["--max-active-prompts", "65"], "--max-active-prompts 65: Input should be less than"),
        (["--run-id", "-3"], "--run-id -3: a run id is 0 or more"),
        (["--model", "/no/such/model.gguf"], "--model '/no/such/model.gguf' is neither a bundled"),
        (["--model", "hf:acme"], "--model hf:acme: repo: "),
    ],
    ids=["max-active-prompts-0", "max-active-prompts-65", "run-id", "model-path", "model-hf"],
)
def test_other_flags_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
):
    why = refused(capsys, tmp_path / "demo", *argv)
    assert why.startswith(expected), why
    assert not (tmp_path / "demo").exists()


@pytest.mark.usefixtures("tripwires")
def test_every_refused_flag_is_named_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    why = refused(capsys, tmp_path / "demo", "--stages", "0", "--prompt", "", "--max-tokens", "-2")
    assert [part.split(":")[0] for part in why.split("; ")] == [
        "--stages 0",
        "--prompt ''",
        "--max-tokens -2",
    ], why


def test_the_checked_request_and_prompt_are_what_the_demo_sends():
    args = demo.parser().parse_args(
        ["--stages", "3", "--max-tokens", "0", "--max-active-prompts", "4", "--chat"]
    )
    plan = check_flags(args)
    assert plan.request.pipeline_stages == 3
    assert plan.request.default_max_tokens == 0
    assert plan.request.max_active_prompts == 4
    assert plan.request.model.bundled == demo.DEFAULT_BUNDLED
    assert plan.prompt.max_tokens == 0 and plan.prompt.chat
    assert plan.prompt.prompt_text == demo.DEFAULT_PROMPT


# --------------------------------------------------------------------------- the model's header


def _model(path: Path, layers: int, chat_template: str | None = None) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", layers)
    if chat_template is not None:
        writer.add_string("tokenizer.chat_template", chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.usefixtures("tripwires")
def test_more_stages_than_layers_is_refused_before_the_dev_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    model = _model(tmp_path / "two.gguf", layers=2, chat_template="{{ messages }}")
    why = refused(capsys, tmp_path / "demo", "--model", str(model), "--stages", "3", "--chat")
    assert why == (
        f"--stages 3: the model {model} has 2 layers, so at most 2 stages "
        "(a stage holds 1 layer or more)"
    )
    assert not (tmp_path / "demo" / "dev.db").exists()


@pytest.mark.usefixtures("tripwires")
def test_chat_with_a_model_without_a_template_is_refused_as_chat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    model = tiny_gguf(tmp_path / "tiny.gguf")  # 1 layer, no chat template
    why = refused(capsys, tmp_path / "demo", "--model", str(model), "--chat", "--stages", "2")
    assert why.startswith(f"--chat: the model {model} has no chat template"), why
    assert why.endswith(
        f"; --stages 2: the model {model} has 1 layer, so at most 1 stage "
        "(a stage holds 1 layer or more)"
    ), why


@pytest.mark.usefixtures("tripwires")
def test_an_unusable_data_dir_is_refused_as_data_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    why = refused(capsys, a_file / "demo")
    assert why.startswith(f"--data-dir {a_file / 'demo'}: cannot use it as the demo's data "), why


# --------------------------------------------------------------------------- as a user runs it


def test_the_module_refuses_at_once_and_starts_nothing(tmp_path: Path):
    """``python -m workers.host.demo --stages 0``: exit status 2 and the flag's reason
    within the interpreter's start (no dev server: that alone takes seconds), no data
    directory made, and no process of its own left (a dev server would be a child)."""
    data_dir = tmp_path / "demo"
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "workers.host.demo", "--data-dir", str(data_dir), "--stages", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - began
    assert proc.returncode == 2, proc
    assert proc.stdout == "", proc.stdout
    assert proc.stderr.startswith(USAGE), proc.stderr
    assert f"{ERROR}--stages 0: a run needs 1 stage or more" in proc.stderr
    assert not data_dir.exists()
    assert took < 30, took  # the interpreter's start: no dev server, no run
