"""Next-token choice from logits: greedy, or temperature / top-k / top-p with a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those cuts.
    A seed makes the sequence reproducible (its own generator, no global RNG state)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


class Sampler:
    """Stateful: one generator per request, so a seed fixes the whole sequence."""

    def __init__(self, params: SamplingParams) -> None:
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if params.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        self.params = params
        self._gen = torch.Generator()
        if params.seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(params.seed)

    def sample(self, logits: torch.Tensor) -> int:
        p = self.params
        logits = logits.detach().float().view(-1).cpu()
        if p.temperature == 0.0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.numel():
            values, indices = torch.topk(logits, p.top_k)
        else:
            values, indices = torch.sort(logits, descending=True)
        probs = torch.softmax(values, dim=-1)
        if p.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            cum = torch.cumsum(probs, dim=-1)
            keep = (cum - probs) < p.top_p
            probs = probs * keep
            probs = probs / probs.sum()
        choice = torch.multinomial(probs, 1, generator=self._gen)
        return int(indices[choice])
