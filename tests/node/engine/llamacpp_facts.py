"""Teacher-forced comparison of a stage with llama.cpp's recorded generations (the facts
scripts/reference/ records: prompt ids, greedy ids, the top logits at every step)."""

from __future__ import annotations

from typing import Any

from workers.node.engine import Stage

# The facts hold llama.cpp's logits rounded to 5 decimals.
LOGIT_TOLERANCE = 1e-5


def logit_mismatches(stage: Stage, g: dict[str, Any]) -> list[tuple[int, int, float, float]]:
    """Fed llama.cpp's own tokens step by step: (step, token id, ours, llama.cpp's) for
    every recorded top logit further than LOGIT_TOLERANCE from ours, and (step, our argmax,
    -1, -1) wherever our choice differs from llama.cpp's."""
    session = stage.new_session(len(g["prompt_ids"]) + len(g["ids"]))
    try:
        logits = session.forward_tokens(g["prompt_ids"])
        out: list[tuple[int, int, float, float]] = []
        for step, (token, top) in enumerate(zip(g["ids"], g["top_logits"], strict=True)):
            if int(logits.argmax()) != token:
                out.append((step, int(logits.argmax()), -1.0, -1.0))
            for tid, value in top:
                ours = float(logits[tid])
                if abs(ours - value) > LOGIT_TOLERANCE:
                    out.append((step, tid, ours, value))
            if step + 1 < len(g["ids"]):
                logits = session.forward_tokens([token])
        return out
    finally:
        session.close()
