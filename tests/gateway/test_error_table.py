"""Every error the gateway can answer is in docs/gateway.md's error table: its status,
``type`` and ``code`` as the code builds them (``ApiError``, ``invalid``, ``unavailable``,
an error body written out), read from the gateway's source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]
GATEWAY = REPO / "workers" / "gateway"
DOC = REPO / "docs" / "gateway.md"
DEFAULT_TYPE = "invalid_request_error"  # ApiError's

Error = tuple[int, str, str | None]  # status, type, code (None: the body's code is null)


def _const(node: ast.AST | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def _arg(call: ast.Call, index: int, name: str) -> ast.AST | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return call.args[index] if len(call.args) > index else None


def _codes(node: ast.AST | None, scope: ast.AST) -> list[str | None]:
    """A code argument's possible values: a literal, either branch of a conditional, or
    the literals a name is bound to in the same function."""
    if node is None or (isinstance(node, ast.Constant) and node.value is None):
        return [None]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _codes(node.body, scope) + _codes(node.orelse, scope)
    if isinstance(node, ast.Name):  # code = "..." on each branch before the call
        bound = [
            sub.value.value
            for sub in ast.walk(scope)
            if isinstance(sub, ast.Assign)
            and [ast.unparse(t) for t in sub.targets] == [node.id]
            and isinstance(sub.value, ast.Constant)
            and isinstance(sub.value.value, str)
        ]
        if bound:
            return list(bound)
    raise AssertionError(f"a code this test cannot read: {ast.unparse(node)}")


def _status_map(node: ast.AST | None, scope: ast.AST) -> dict[int, str] | None:
    """``code = {404: "not_found", ...}.get(exc.status_code)``: the statuses it maps."""
    if not isinstance(node, ast.Name):
        return None
    for sub in ast.walk(scope):
        if (
            isinstance(sub, ast.Assign)
            and [ast.unparse(t) for t in sub.targets] == [node.id]
            and isinstance(sub.value, ast.Call)
            and isinstance(sub.value.func, ast.Attribute)
            and isinstance(sub.value.func.value, ast.Dict)
        ):
            d = sub.value.func.value
            return {int(_const(k)): str(_const(v)) for k, v in zip(d.keys, d.values, strict=True)}  # type: ignore[call-overload]
    return None


def gateway_errors() -> set[Error]:
    found: set[Error] = set()
    for path in sorted(GATEWAY.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for call in ast.walk(fn):
                if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
                    continue
                name = call.func.id
                if name == "invalid":
                    found |= {(400, DEFAULT_TYPE, c) for c in _codes(_arg(call, 2, "code"), fn)}
                elif name == "unavailable":
                    found |= {(503, "server_error", c) for c in _codes(_arg(call, 1, "code"), fn)}
                elif name == "ApiError" and fn.name not in ("invalid", "unavailable"):
                    kind = str(_const(_arg(call, 99, "type")) or DEFAULT_TYPE)
                    code = _arg(call, 99, "code")
                    mapped = _status_map(code, fn)
                    if mapped is not None:  # the status is the mapped one, or no code
                        found |= {(s, kind, c) for s, c in mapped.items()}
                        continue
                    status = _const(call.args[0])
                    assert isinstance(status, int), f"{path.name}: {ast.unparse(call)}"
                    found |= {(status, kind, c) for c in _codes(code, fn)}
        # An error body written out (the API key check, before any route).
        for d in ast.walk(tree):
            if isinstance(d, ast.Dict) and "code" in [_const(k) for k in d.keys]:
                fields = {_const(k): v for k, v in zip(d.keys, d.values, strict=True)}
                kind = _const(fields.get("type"))
                if isinstance(kind, str):  # (ApiError.body's is the error's own)
                    found |= {(401, kind, c) for c in _codes(fields["code"], tree)}
    return found


def documented_errors() -> set[Error]:
    section = DOC.read_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    found: set[Error] = set()
    for row in re.findall(r"^\| (\d{3}) \| `(\w+)` \| (.*?) \|", section, re.M):
        status, kind, codes = int(row[0]), row[1], row[2]
        names: list[str | None] = list(re.findall(r"`(\w+)`", codes))
        if "null" in codes.split("`"):  # written as "null": no code
            names.append(None)
        found |= {(status, kind, c) for c in names}
    return found


def test_every_error_the_gateway_answers_is_in_the_docs_error_table():
    errors = gateway_errors()
    # The extraction finds what it should (a broken one would pass with nothing).
    assert (429, "rate_limit_error", "server_limit") in errors, errors
    assert (404, DEFAULT_TYPE, "not_found") in errors and (
        401,
        DEFAULT_TYPE,
        "invalid_api_key",
    ) in errors
    missing = sorted(errors - documented_errors(), key=str)
    assert not missing, f"docs/gateway.md's error table lacks (status, type, code): {missing}"
