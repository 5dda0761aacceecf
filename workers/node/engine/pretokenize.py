"""Pre-tokenizers (word splitting before BPE) for each `tokenizer.ggml.pre` type.

llama.cpp splits text with a *sequence* of regexes: every regex is applied to every
chunk produced by the previous one, and both the matches and the unmatched gaps
between them become chunks. Lookaheads therefore never see past a chunk boundary,
which is why e.g. SmolLM's "digits first" step changes how whitespace before a
digit is grouped. This module reproduces that behaviour with the `regex` package
(Python's `re` has no \\p{L}/\\p{N}).

Two of llama.cpp's regexes (the GPT-2 one and the Llama-3 one) are run by
hand-written splitters there, not by a regex engine. They differ from a real regex
in one corner: code points that are unassigned in Unicode ("undefined" flags) never
join a punctuation run and always become single-character words. The patterns
marked `custom` below add that behaviour (exclude \\p{Cn}, catch-all `.` last).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import regex

# --- the regexes, as llama.cpp uses them --------------------------------------------

_CATCH_ALL = "|(?s:.)"

_CONTRACTIONS_CASED = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

# GPT-2 (llama.cpp: custom splitter `unicode_regex_split_custom_gpt2`).
_GPT2_CUSTOM = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}\p{Cn}]+"
    r"|\s+(?!\S)|\s+|(?s:.)"
)

# Llama 3 (llama.cpp: custom splitter `unicode_regex_split_custom_llama3`).
_LLAMA3_CUSTOM = (
    _CONTRACTIONS_CASED + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}\p{Cn}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+|(?s:.)"
)

# Qwen2 (llama.cpp runs this one through std::regex, so it is a plain regex).
_QWEN2 = (
    _CONTRACTIONS_CASED
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp's fallback for pre type "default" (four passes).
_DEFAULT_PASSES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    _GPT2_CUSTOM,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp treats one `tokenizer.ggml.pre` value."""

    passes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token skips BPE merges
    clean_spaces: bool = True  # llama_detokenize's clean_up_tokenization_spaces
    default_add_bos: bool = False


_SMOLLM_LIKE = PreTokenizerSpec(passes=(r"\p{N}", _GPT2_CUSTOM))
_GPT2 = PreTokenizerSpec(passes=(_GPT2_CUSTOM,))
_LLAMA3 = PreTokenizerSpec(passes=(_LLAMA3_CUSTOM,), ignore_merges=True, default_add_bos=True)

# Names follow llama.cpp's `llama_vocab::impl::load`.
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec(passes=_DEFAULT_PASSES),
    # GPT-2 regex only
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "jais": _GPT2,
    "exaone4": _GPT2,
    "trillion": PreTokenizerSpec(passes=(_GPT2_CUSTOM,), clean_spaces=False),
    # digits split individually, then GPT-2
    "smollm": PreTokenizerSpec(passes=(r"\p{N}", _GPT2_CUSTOM), clean_spaces=False),
    "starcoder": _SMOLLM_LIKE,
    "refact": _SMOLLM_LIKE,
    "codeshell": _SMOLLM_LIKE,
    "exaone": _SMOLLM_LIKE,
    "minerva-7b": _SMOLLM_LIKE,
    "command-r": PreTokenizerSpec(passes=(r"\p{N}", _GPT2_CUSTOM), clean_spaces=False),
    # Llama 3
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "dbrx": PreTokenizerSpec(passes=(_LLAMA3_CUSTOM,)),
    "smaug-bpe": PreTokenizerSpec(passes=(_LLAMA3_CUSTOM,)),
    # Qwen2
    "qwen2": PreTokenizerSpec(passes=(_QWEN2,), clean_spaces=False),
    "deepseek-r1-qwen": PreTokenizerSpec(passes=(_QWEN2,), clean_spaces=False),
    "stablelm2": PreTokenizerSpec(passes=(_QWEN2,)),
    "megrez": PreTokenizerSpec(passes=(_QWEN2,)),
}


class PreTokenizer:
    """Splits text into words exactly the way llama.cpp's `unicode_regex_split` does."""

    def __init__(self, passes: Sequence[str]) -> None:
        # (pattern, ends in a catch-all) -- catch-all patterns leave no gaps to keep
        self._passes = [(regex.compile(p), p.endswith(_CATCH_ALL)) for p in passes]

    def split(self, text: str) -> list[str]:
        if not text:
            return []
        chunks = [text]
        for pattern, covers in self._passes:
            out: list[str] = []
            for chunk in chunks:
                if covers:
                    # Custom-style patterns end in a catch-all: no gaps to keep.
                    out.extend(pattern.findall(chunk))
                    continue
                pos = 0
                for m in pattern.finditer(chunk):
                    start, end = m.span()
                    if start == end:
                        continue
                    if start > pos:
                        out.append(chunk[pos:start])
                    out.append(chunk[start:end])
                    pos = end
                if pos < len(chunk):
                    out.append(chunk[pos:])
            chunks = out
        return chunks
