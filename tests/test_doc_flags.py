"""Every flag the docs show with one of the project's commands is one that command takes
(issue 38, item 10): the shell code blocks of README.md and docs/*.md (and their inline
code that starts with a command, such as `mvp-follow --run-id N`) are read for
invocations of ``mvp-orchestrator``, ``mvp-gateway``, ``mvp-chat``, ``mvp-follow``,
``python -m <our module>``, ``python scripts/<name>.py`` and ``temporal/dev-server``,
and each ``--flag`` shown with one (its comment on the same line included, where the
README lists a script's options) must appear in that command's ``--help``, run once per
command (tests/test_entry_points.py runs and caches the same ``--help``). A flag renamed
or removed while a page still shows it fails here."""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.test_entry_points import (
    DOCS,
    OUR_PACKAGES,
    REPO,
    console_script_path,
    console_scripts,
    run_help,
)

pytestmark = pytest.mark.quick

# Fenced blocks of these languages (none named: a shell session too) hold commands.
SHELL_BLOCKS = {"", "sh", "bash", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", "$("}
# Words that may come before a command in its place: an environment assignment, these.
PREFIXES = {"exec", "nohup", "time", "env", "sudo", "!"}
DEV_SERVER = "temporal/dev-server"
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def shell_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, logical line) of each shell code block, continuations joined."""
    fence: str | None = None
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if fence is None:
            opened = re.match(r"(```|~~~)\s*([\w-]*)", stripped)
            if opened and opened.group(2) in SHELL_BLOCKS:
                fence = opened.group(1)
            elif opened:
                fence = "skip:" + opened.group(1)
            continue
        if stripped.startswith(fence.removeprefix("skip:")):
            fence = None
            continue
        if fence.startswith("skip:"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, pending + stripped
        pending = ""


def inline_commands(text: str) -> Iterator[tuple[int, str]]:
    """(line number, code) of each inline code span outside code blocks (such as
    `` `mvp-follow --run-id N` ``); only those that start with one of our commands count."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(r"\s*(```|~~~)", line):
            fenced = not fenced
            continue
        if not fenced:
            for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
                yield number, span


def tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        words = list(lexer)
    except ValueError:  # an unbalanced quote: the words as they stand
        words = line.split()
    # A command substitution starts a command: X=$(python -m ...) is X= $( python -m ...
    split: list[str] = []
    for word in words:
        before, sub, after = word.partition("$(")
        split.extend(w for w in (before, sub, after) if w)
    return split


def in_command_place(words: list[str], i: int) -> bool:
    """Whether ``words[i]`` is where a command goes (not an argument of another one,
    such as the task queue ``mvp-orchestrator`` of a ``temporal workflow start``)."""
    for word in reversed(words[:i]):
        if word in SEPARATORS:
            return True
        if word not in PREFIXES and not re.fullmatch(r"[A-Za-z_]\w*=\S*", word):
            return False
    return True


def command_at(words: list[str], i: int) -> tuple[tuple[str, ...], str, int] | None:
    """The command that starts at ``words[i]``: (its --help command line, its name, the
    index of its first argument); None when none of ours does."""
    word = words[i]
    if not in_command_place(words, i):
        return None
    base = word.rsplit("/", 1)[-1]
    if base in console_scripts() and (word == base or word.endswith(f".venv/bin/{base}")):
        return (str(console_script_path(base)), "--help"), base, i + 1
    if word == DEV_SERVER or word.endswith("/" + DEV_SERVER):
        return (str(REPO / DEV_SERVER), "--help"), DEV_SERVER, i + 1
    if re.fullmatch(r"(\S*/)?python[\d.]*", word) and i + 1 < len(words):
        after = words[i + 1]
        if after == "-m" and i + 2 < len(words):
            module = words[i + 2]
            if module.split(".")[0] in OUR_PACKAGES:
                return (sys.executable, "-m", module, "--help"), f"python -m {module}", i + 3
        elif re.fullmatch(r"scripts/[\w/]+\.py", after):
            return (sys.executable, after, "--help"), after, i + 2
    return None


def documented_flags() -> dict[tuple[str, ...], dict[str, set[str]]]:
    """By --help command line: each flag shown with the command, and where."""
    found: dict[tuple[str, ...], dict[str, set[str]]] = {}
    for doc in DOCS:
        where = doc.relative_to(REPO)
        text = doc.read_text()
        spans = [(n, c) for n, c in inline_commands(text) if tokens(c) and command_at(tokens(c), 0)]
        for number, line in [*shell_lines(text), *spans]:
            words = tokens(line)
            i = 0
            while i < len(words):
                cmd = command_at(words, i)
                if cmd is None:
                    i += 1
                    continue
                help_cmd, name, i = cmd
                flags = found.setdefault((name, *help_cmd), {})
                while i < len(words) and words[i] not in SEPARATORS:
                    word = words[i].lstrip("[(")
                    for flag in FLAG.findall(word) if word.startswith("--") else []:
                        flags.setdefault(flag, set()).add(f"{where}:{number}")
                        value = words[i + 1].rstrip("])") if i + 1 < len(words) else ""
                        shown = re.fullmatch(r"[\w.-]+(?:\|[\w.-]+)+", value)
                        if word == flag and shown:
                            key = (name, *help_cmd, flag)
                            CHOICES.setdefault(key, {}).setdefault(
                                frozenset(shown.group().split("|")), set()
                            ).add(f"{where}:{number}")
                    i += 1
    return found


# (name, its --help command line..., flag) -> each set of values the docs show the flag
# take (`--provider process|docker|vastai`) -> where.
CHOICES: dict[tuple[str, ...], dict[frozenset[str], set[str]]] = {}


DOCUMENTED = documented_flags()


@pytest.fixture(scope="module", autouse=True)
def helps(request: pytest.FixtureRequest) -> None:
    """Every --help the selected tests of this module read, run side by side (most of
    their time is imports)."""
    wanted: set[tuple[str, ...]] = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is sys.modules[__name__] and callspec is not None:
            wanted.add(tuple(callspec.params["key"][1:]))
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        list(pool.map(run_help, sorted(wanted)))


def test_the_docs_show_the_commands_this_test_checks() -> None:
    """The parsing finds what the docs do show (so that a change to it cannot quietly
    check nothing)."""
    names = {key[0] for key in DOCUMENTED}
    assert {"mvp-orchestrator", "mvp-gateway", "mvp-chat", DEV_SERVER} <= names, names
    assert "python -m workers.orchestrator" in names and "scripts/bench_serve.py" in names
    assert {"--provider", "--dashboard", "--runtime-config"} <= set(
        DOCUMENTED[next(k for k in DOCUMENTED if k[0] == "mvp-orchestrator")]
    )


@pytest.mark.parametrize(
    "key", sorted(k for k in DOCUMENTED if DOCUMENTED[k]), ids=lambda key: key[0]
)
def test_every_documented_flag_is_in_the_commands_help(key: tuple[str, ...]) -> None:
    name, *help_cmd = key
    done = run_help(tuple(help_cmd))
    text = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} --help exited {done.returncode}:\n{text[-2000:]}"
    stale = {
        flag: sorted(where)
        for flag, where in DOCUMENTED[key].items()
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
    }
    assert not stale, f"{name}: flags the docs show that its --help does not know: {stale}"
    # A flag shown with its values (`--provider process|docker`) shows them all.
    for flag in DOCUMENTED[key]:
        taken = help_choices(text, flag)
        for shown, where in CHOICES.get((*key, flag), {}).items():
            assert taken is None or shown == taken, (
                f"{name} {flag}: the docs show {'|'.join(sorted(shown))} ({sorted(where)}), "
                f"its --help {'|'.join(sorted(taken))}"
            )


def help_choices(text: str, flag: str) -> frozenset[str] | None:
    """The values ``flag`` takes as ``--help`` lists them (argparse's ``{a,b}`` or a
    usage line's ``a|b``); None where it lists none."""
    listed = re.search(
        rf"(?<![\w-]){re.escape(flag)}[ =](?:\{{([^}}]+)\}}|([\w.-]+(?:\|[\w.-]+)+))", text
    )
    if listed is None:
        return None
    return frozenset(re.split(r"[,|]", listed.group(1) or listed.group(2)))


# ---------------------------------------------------------------- claims of the docs


def test_the_bundled_dev_server_registers_and_names_every_search_attribute() -> None:
    """temporal/dev-server registers each search attribute the workflows set (the
    orchestrator worker refuses a namespace without them) and its header says so."""
    from temporal.devserver import SEARCH_ATTRIBUTES

    script = (REPO / DEV_SERVER).read_text()
    header = "".join(line for line in script.splitlines() if line.startswith("#"))
    for name, kind in SEARCH_ATTRIBUTES.items():
        assert f"--search-attribute {name}={kind}" in script, name
        assert name in header, f"{DEV_SERVER}'s header does not name {name}"


def test_host_md_gives_max_active_prompts_its_range() -> None:
    from mvp_core.models.run_request import MAX_ACTIVE_PROMPTS

    host = (REPO / "docs" / "host.md").read_text()
    assert f"| `max_active_prompts` | integer 1-{MAX_ACTIVE_PROMPTS} " in host
    assert f"less than or equal to {MAX_ACTIVE_PROMPTS}`" in host
    assert "one active, up to 7" not in host  # the RPC's queue: max_active_prompts active
