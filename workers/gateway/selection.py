"""Which run serves a request, when one gateway serves several runs (DECISIONS 90): pure
functions over what the gateway already knows of each run, so that choosing costs no
Temporal call.

- A run's **model id** is the name ``/v1/models`` lists and a client passes as
  ``model``: the alias the operator gave it (``--workflow-id mvp-run-7=ALIAS``), else
  its GGUF file's name without ``.gguf``. It also answers to its other names (the file
  name, the model's ``general.name``, its file stem when it has an alias) where no run
  has that name as its id and those names do not point at two models.
- Runs with the same model id are **replicas**: a request goes to the one whose queue
  is shortest by the gateway's own count of its requests in flight there, against the
  run's capacity (``max_active_prompts``): first a prompt-ready run over one that is
  not (or that just refused a prompt as not ready), then the fewest prompts that would
  wait before this one (``max(0, in_flight + 1 - max_active)``), then the lightest load
  (``in_flight / max_active``), then the run chosen least recently (so an idle pair
  takes turns), then the workflow id.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

MAX_ALIAS_CHARS = 128
# An OpenAI-style model id: "gpt-4o-mini", "ft:gpt-3.5:org:id", "meta-llama/Llama-3-8B".
_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


class AliasError(ValueError):
    """An alias that cannot name a model; the message says why."""


def check_alias(alias: str) -> str:
    """``alias`` when it can be a model id: 1 to 128 characters, a letter or digit first,
    then letters, digits and ``. _ : / @ + -`` (no spaces, nothing a URL must escape but
    ``/``); AliasError otherwise."""
    if not alias:
        raise AliasError("an alias must not be empty")
    if len(alias) > MAX_ALIAS_CHARS:
        raise AliasError(f"an alias has at most {MAX_ALIAS_CHARS} characters")
    if not _ALIAS.fullmatch(alias):
        raise AliasError(
            "an alias starts with a letter or digit and holds only letters, digits and '._:/@+-'"
        )
    return alias


@dataclass(frozen=True)
class RunView:
    """What selection knows of one served run, all of it held by the gateway."""

    key: str  # the run's workflow id
    model: str  # its model id
    names: frozenset[str] = frozenset()  # the other names it answers to
    ready: bool = True  # prompt-ready as far as the gateway knows
    in_flight: int = 0  # this gateway's prompts in the run, admitted or being admitted
    max_active: int = 1  # prompts the run generates at once
    last_chosen: int = 0  # when the gateway last sent it a request (a counter; 0: never)


@dataclass(frozen=True)
class Resolved:
    """What a requested name points at: the model id and its runs (none: unknown), or
    the model ids it could mean (``ambiguous``, two or more)."""

    model: str | None
    runs: tuple[RunView, ...] = ()
    ambiguous: tuple[str, ...] = ()


def resolve(name: str, runs: Iterable[RunView]) -> Resolved:
    """The runs a request for ``name`` may go to: those whose model id is ``name``;
    else those that answer to it by another name, when all of them serve one model id."""
    runs = list(runs)
    exact = tuple(r for r in runs if r.model == name)
    if exact:
        return Resolved(name, exact)
    others = [r for r in runs if name in r.names]
    models = sorted({r.model for r in others})
    if len(models) == 1:
        model = models[0]
        return Resolved(model, tuple(r for r in runs if r.model == model))
    return Resolved(None, (), tuple(models))


def rank(runs: Sequence[RunView]) -> list[RunView]:
    """Replicas of one model, the one to try first first (the module's order)."""

    def key(r: RunView) -> tuple[bool, int, Fraction, int, str]:
        capacity = max(1, r.max_active)
        waiting = max(0, r.in_flight + 1 - capacity)
        return (not r.ready, waiting, Fraction(r.in_flight, capacity), r.last_chosen, r.key)

    return sorted(runs, key=key)


def listed(runs: Iterable[RunView]) -> list[str]:
    """The model ids ``/v1/models`` lists: one per model, however many replicas."""
    return sorted({r.model for r in runs})
