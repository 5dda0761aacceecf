"""Every program the project offers answers ``--help``: the console scripts declared in
pyproject.toml, the ``python -m`` modules and the scripts that README.md and docs/ tell a
user to run (or that parse arguments). A declared script whose module is missing, or a
module that fails on import, fails here instead of in a new user's terminal."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
OUR_PACKAGES = ("workers", "activities", "mvp_core", "workflows", "temporal", "scripts")
ALWAYS = {"workers.host.demo", "workers.orchestrator", "workers.host.chat"}


def console_scripts() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    scripts: dict[str, str] = project.get("scripts", {})
    return scripts


def documented_modules() -> set[str]:
    found = set(ALWAYS)
    for doc in DOCS:
        for module in re.findall(r"python[\d.]* -m ([A-Za-z_][\w.]*)", doc.read_text()):
            if module.split(".")[0] in OUR_PACKAGES:
                found.add(module)
    return found


def scripts() -> set[str]:
    found = {
        str(path.relative_to(REPO))
        for path in (REPO / "scripts").rglob("*.py")
        if "argparse" in path.read_text()
    }
    for doc in DOCS:
        found.update(re.findall(r"\b(scripts/[\w/]+\.py)\b", doc.read_text()))
    return found


@functools.cache
def run_help(cmd: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """``cmd`` (ending in ``--help``) run once per test session: what it printed
    (tests/test_doc_flags.py reads the same output for the flags the docs show).
    ``temporal/dev-server --help`` would make its database's folder in the checkout:
    its database is named elsewhere."""
    env = {**os.environ, "MVP_TEMPORAL_DB": str(Path(tempfile.gettempdir()) / "mvp-help.db")}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def console_script_path(name: str) -> Path:
    return Path(sys.executable).with_name(name)


# The project's own records (docs/decisions.md, the contracts, issues): a user's --help
# explains itself instead of citing them. scripts/ are the developers' tools and may.
INTERNAL_RECORD = re.compile(r"\b(?:DECISIONS|CONTRACTS|ARCHITECTURE)\b|\bissue \d")


def assert_help(cmd: list[str], what: str, for_users: bool = False) -> None:
    done = run_help(tuple(cmd))
    assert done.returncode == 0, f"{what} --help exited {done.returncode}:\n{done.stderr}"
    assert done.stdout.startswith("usage:"), f"{what} --help printed:\n{done.stdout}"
    if for_users:
        cited = [line.strip() for line in done.stdout.splitlines() if INTERNAL_RECORD.search(line)]
        assert not cited, f"{what} --help cites the project's internal records: {cited}"


@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_console_script_answers_help(name: str):
    target = console_scripts()[name]
    module = target.partition(":")[0]
    assert importlib.util.find_spec(module) is not None, f"{name} = {target!r}: no such module"
    installed = console_script_path(name)
    assert installed.exists(), f"{name} is not installed in the venv: pip install -e ."
    assert_help([str(installed), "--help"], name, for_users=True)


@pytest.mark.parametrize("module", sorted(documented_modules()))
def test_python_m_module_answers_help(module: str):
    assert_help([sys.executable, "-m", module, "--help"], f"python -m {module}", for_users=True)


@pytest.mark.parametrize("script", sorted(scripts()))
def test_script_answers_help(script: str):
    assert (REPO / script).is_file(), f"{script} is documented but does not exist"
    assert_help([sys.executable, script, "--help"], script)
