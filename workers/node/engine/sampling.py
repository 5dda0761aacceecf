"""Next-token choice from logits: greedy, or temperature / top-k / top-p with a seed."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mvp_core.constrain import Constraint

    from .formats import StageFormats

# One definition of the parameters, torch-free, beside the wire header that carries them.
from workers.node.dataplane.records import SamplingParams, TokenLogprobs

__all__ = [
    "Sampler",
    "SamplingParams",
    "TokenLogprobs",
    "check_resume",
    "draw_seed",
    "token_logprobs",
]

_MASK64 = (1 << 64) - 1


def check_resume(resumed: int, params: SamplingParams, max_new_tokens: int | None) -> None:
    """A resume that cannot give the first run's tokens raises ValueError: a sampled one
    without its seed, or one that had more tokens than it may generate."""
    if resumed and params.temperature > 0 and params.seed is None:
        raise ValueError("a sampled prompt resumes only with the seed it first ran with")
    if max_new_tokens is not None and resumed > max_new_tokens:
        raise ValueError(f"{resumed} tokens resumed, more than max_new_tokens {max_new_tokens}")


def draw_seed(seed: int, index: int) -> int:
    """The generator's seed for the ``index``-th sampled token of a request seeded ``seed``:
    splitmix64 of the pair, so neighbouring seeds and indices give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log probability under ``logits`` (one step's raw logits [vocab]: the
    log-softmax over the whole vocabulary, before temperature, top-k and top-p), and the
    ``top`` most likely tokens' (most likely first, ties by the lower token id).

    A function of the row's values only: a row's logits are the same batched or alone
    (session.BatchSession), so are its logprobs. The row is copied into a tensor of its
    own first, so that its place in a batch's logits cannot matter either."""
    row = logits.detach().reshape(-1).to(device="cpu", dtype=torch.float32).clone()
    lp = torch.log_softmax(row, dim=-1)
    pairs: tuple[tuple[int, float], ...] = ()
    k = min(top, lp.numel())
    if k > 0:
        # Every token at least as likely as the k-th (ties past it included), then sorted
        # by (logprob descending, id ascending): torch.topk orders ties as it likes.
        kth = torch.topk(lp, k).values[-1]
        ids = torch.nonzero(lp >= kth).view(-1).tolist()
        values = lp[ids].tolist()
        ranked = sorted(zip(ids, values, strict=True), key=lambda p: (-p[1], p[0]))[:k]
        pairs = tuple((int(i), float(v)) for i, v in ranked)
    return TokenLogprobs(float(lp[token]), pairs)


class Sampler:
    """One per request. The ``index``-th token it samples depends on the logits, the
    parameters, the seed and ``index`` only, never on the draws before it: the generator
    is reseeded from (seed, index) for every token. So a sequence that is re-prefilled
    with its prompt and the tokens it already has (stage recovery) continues with a
    Sampler made at ``index=len(generated)`` and samples exactly what it would have.
    Without a seed one is drawn at random once (``seed`` says which).

    A prompt with a ``response_format`` (DECISIONS 89) gets its constraint from the
    stage's ``formats``: each step's logits are masked (a refused token's logit -inf,
    the others untouched) before temperature, top-k and top-p, and the sampled token
    advances it. Its mask is its own: other rows of a batch are never touched."""

    def __init__(
        self, params: SamplingParams, index: int = 0, formats: StageFormats | None = None
    ) -> None:
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if params.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if index < 0:
            raise ValueError("index must be >= 0")
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.index = index
        self._gen = torch.Generator()
        self.constraint: Constraint | None = None
        if params.response_format is not None:
            if formats is None:
                raise ValueError("a response format needs the stage's vocabulary (formats)")
            self.constraint = formats.constraint(params.response_format)

    def skip(self, token: int) -> None:
        """``token`` was taken without a draw (a resumed one): the next draws as after it."""
        self.index += 1
        if self.constraint is not None:
            self.constraint.take(token)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (one row, float32 on the CPU) with the tokens the format refuses
        at -inf; the row itself where there is no format."""
        if self.constraint is None:
            return logits
        allowed = torch.frombuffer(self.constraint.allowed(), dtype=torch.bool)
        n = logits.numel()
        if allowed.numel() < n:  # logits past the tokenizer's vocabulary: never
            allowed = torch.cat([allowed, allowed.new_zeros(n - allowed.numel())])
        return logits.masked_fill(~allowed[:n], float("-inf"))

    def choose(self, logits: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        """``sample``, with the token's logprobs where the parameters ask for them."""
        token = self.sample(logits)
        if not self.params.logprobs:
            return token, None
        return token, token_logprobs(logits, token, self.params.top_logprobs)

    def sample(self, logits: torch.Tensor) -> int:
        p = self.params
        index = self.index
        self.index += 1
        logits = self.masked(logits.detach().float().view(-1).cpu())
        token = self._draw(logits, p, index)
        if self.constraint is not None:
            self.constraint.take(token)
        return token

    def _draw(self, logits: torch.Tensor, p: SamplingParams, index: int) -> int:
        if p.temperature == 0.0:
            return int(torch.argmax(logits))
        self._gen.manual_seed(draw_seed(self.seed, index))
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
