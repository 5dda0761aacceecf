"""Tokenizer built only from GGUF metadata, producing the same ids as llama.cpp.

The engine has to agree token-for-token with llama.cpp (the reference the benchmarks
and correctness checks compare against), so this module follows llama.cpp's
`llama-vocab.cpp` rather than Hugging Face `tokenizers`: the same special-token
partitioning, the same per-`tokenizer.ggml.pre` word splitting (see pretokenize.py),
the same BPE merge order, the same SentencePiece bigram merging with byte fallback,
and the same `token_to_piece`/`detokenize` rules for turning ids back into text.

Supported: `tokenizer.ggml.model` "gpt2" (byte-level BPE) and "llama"
(SentencePiece-style). Anything else raises TokenizerError naming the value.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gguf.constants import Keys

from workers.node.engine.chat_template import ChatTemplateError, render_chat_template
from workers.node.engine.merges import merge_bpe, merge_spm
from workers.node.engine.pretokenize import PRE_TOKENIZERS, PreTokenizer, PreTokenizerSpec

__all__ = ["IncrementalDecoder", "Tokenizer", "TokenizerError", "read_gguf_metadata"]


class TokenizerError(Exception):
    """Unsupported or broken tokenizer metadata, bad token ids, or a failing chat template."""


# Token attributes (bit flags, as llama.cpp's llama_token_attr).
_UNKNOWN = 1 << 0
_UNUSED = 1 << 1
_NORMAL = 1 << 2
_CONTROL = 1 << 3
_USER_DEFINED = 1 << 4
_BYTE = 1 << 5

# GGUF `tokenizer.ggml.token_type` values -> attributes (0 and unknown values: undefined).
_TYPE_TO_ATTR = {1: _NORMAL, 2: _UNKNOWN, 3: _CONTROL, 4: _USER_DEFINED, 5: _UNUSED, 6: _BYTE}

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space

# Token texts llama.cpp recognises by name (it has no metadata for most of them).
_EOT_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend▁of▁sentence\uff5c>",
        "<end_of_utterance>",
    }
)  # fmt: skip
_EOM_TEXTS = frozenset({"<|eom_id|>"})
_FIM_TEXTS: dict[str, frozenset[str]] = {
    "pre": frozenset({"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim▁begin\uff5c>",
                      "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>"}),
    "suf": frozenset({"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim▁hole\uff5c>",
                      "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>"}),
    "mid": frozenset({"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim▁end\uff5c>",
                      "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>"}),
    "pad": frozenset({"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"}),
    "rep": frozenset({"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"}),
    "sep": frozenset({"<|file_sep|>"}),
}  # fmt: skip
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
        "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
        "<turn|>", "<|tool_response>", "<\uff5cend▁of▁sentence\uff5c>", "[e~[",
    }
)  # fmt: skip
_ALWAYS_RENDERED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})

_WORD_CACHE_LIMIT = 200_000  # memoised pre-token words (cleared when full)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    for b in printable:
        table[b] = chr(b)
    n = 0
    for b in range(256):
        if not table[b]:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
# str.translate table: latin-1 char (one per raw byte) -> byte-level character.
_LATIN1_TO_BYTE_CHAR = {b: c for b, c in enumerate(_BYTE_TO_CHAR)}


def _byte_level_encode(word: str) -> str:
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_LATIN1_TO_BYTE_CHAR)


# str.translate table: byte-level character -> the latin-1 character of its byte; every
# other character below 256 -> U+FFFF, so that latin-1 encoding fails for any character
# outside the alphabet (as those above 256 that the table leaves alone do).
_BYTE_CHAR_TO_LATIN1 = {
    **{x: 0xFFFF for x in range(256)},
    **{ord(c): b for c, b in _CHAR_TO_BYTE.items()},
}


def _byte_level_decode(text: str) -> bytes:
    """llama.cpp's llama_decode_text (including its odd marker for foreign characters)."""
    try:
        return text.translate(_BYTE_CHAR_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        out = bytearray()
        for c in text:
            b = _CHAR_TO_BYTE.get(c)
            if b is not None:
                out.append(b)
            else:
                out += b"[UNK_BYTE_0x" + c.encode().hex().encode() + text.encode() + b"]"
        return bytes(out)


def _clean_spaces(text: bytes) -> bytes:
    """llama_detokenize's clean_up_tokenization_spaces passes (byte-for-byte)."""
    if not text:
        return text
    # pass 1: drop a space before ? ! . ,
    buf = bytearray(text[:1])
    for i in range(1, len(text)):
        x = text[i]
        if text[i - 1] == 0x20 and x in b"?!.,":
            buf.pop()
        buf.append(x)
    # pass 2: " ' " -> "'"
    src = bytes(buf)
    buf = bytearray(src[:1])
    i = 1
    nulled = -1  # llama.cpp overwrites the dropped space with NUL, in place
    while i < len(src):
        x = src[i]
        prev = 0 if i - 1 == nulled else src[i - 1]
        if x == 0x27 and i + 1 < len(src) and prev == 0x20 and src[i + 1] == 0x20:
            buf.pop()
            i += 1  # the following space is dropped as well
            nulled = i
        buf.append(x)
        i += 1
    # pass 3: " 's", " 'm", " 're", " 've" -> no space
    src = bytes(buf)
    buf = bytearray(src[:1])
    n = len(src)
    for i in range(1, n):
        x = src[i]
        if src[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = src[i + 1]
            if x1 in b"sm":
                buf.pop()
            elif x1 not in b"td" and i + 2 < n and src[i + 1 : i + 3] in (b"re", b"ve"):
                buf.pop()
        buf.append(x)
    return bytes(buf)


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The `tokenizer.*` key/values of a GGUF file, as plain Python values.

    Uses the engine's lazy reader: ~0.1 s for SmolLM2's 98k vocabulary strings, where
    ``gguf.GGUFReader`` takes ~2 s decoding every array of the file.
    """
    from .gguf_reader import read_metadata

    name = os.fspath(path)
    try:
        return read_metadata(name, "tokenizer.")
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read GGUF file {name!r}: {e}") from e


class IncrementalDecoder:
    """Streams text for a growing sequence of token ids.

    A token can end in the middle of a multi-byte UTF-8 character (byte-fallback and
    byte-level tokens do this for emoji and CJK), so bytes are held back until the
    character is complete; `push` never returns a broken character. Joining every
    `push` result and the final `flush` gives `Tokenizer.decode(ids)` (except for
    vocabularies whose llama.cpp `clean_spaces` flag is set, where `decode` also
    removes spaces before punctuation; streaming, like llama.cpp's server, does not).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became complete with it."""
        piece = self._tokenizer.token_to_bytes(token_id)
        if self._first:
            self._first = False
            if self._tokenizer.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """End of stream: return held-back bytes (an incomplete character becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


class Tokenizer:
    """Text <-> token ids for one GGUF model, matching llama.cpp."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    unk_token_id: int | None
    eog_token_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    has_chat_template: bool
    chat_template: str | None
    model: str
    pre: str

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer stored in a GGUF file's metadata (no tensors are read)."""
        return cls.from_metadata(read_gguf_metadata(path))

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF key -> value mapping (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        return cls(metadata)

    def __init__(self, metadata: Mapping[str, Any]) -> None:
        def get(key: str, default: Any = None) -> Any:
            value = metadata.get(key, default)
            return default if value is None else value

        model = get(Keys.Tokenizer.MODEL)
        if model is None:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.model")
        self.model = str(model)
        tokens = get(Keys.Tokenizer.LIST)
        if not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")

        bos, eos, unk = self._family(get)
        self.add_space_prefix = bool(get(Keys.Tokenizer.ADD_PREFIX, self.add_space_prefix))
        n = self._vocabulary(tokens, get)
        eot, eom, fim = self._special_ids_of(get, n, bos, eos, unk)
        self._end_of_generation(eot, eom, fim)

        # -- special-token partitioning order: longest text first
        special_ids = [
            i for i, a in enumerate(self._attrs) if a & (_CONTROL | _USER_DEFINED | _UNKNOWN)
        ]
        special_ids.sort(key=lambda i: -len(self._tokens[i].encode()))
        self._special_ids = special_ids

        # -- token -> bytes (token_to_piece with special=False and special=True)
        self._pieces = [self._piece(i, special=False) for i in range(n)]
        self._pieces_special = [self._piece(i, special=True) for i in range(n)]

        self._pre_tokenizer = PreTokenizer(self._spec.passes) if self._spec is not None else None
        self._ignore_merges = self._spec.ignore_merges if self._spec is not None else False
        self._word_cache: dict[str, tuple[int, ...]] = {}

        template = get(Keys.Tokenizer.CHAT_TEMPLATE)
        self.chat_template = str(template) if template else None
        self.has_chat_template = self.chat_template is not None

    def _family(self, get: Callable[..., Any]) -> tuple[int | None, int | None, int | None]:
        """The vocabulary's family (byte-level BPE or SentencePiece) and its defaults; the
        default BOS, EOS and unknown ids."""
        self._spec: PreTokenizerSpec | None = None
        if self.model == "gpt2":
            self._is_bpe = True
            self.pre = str(get(Keys.Tokenizer.PRE, "default")) or "default"
            spec = PRE_TOKENIZERS.get(self.pre)
            if spec is None:
                supported = ", ".join(sorted(PRE_TOKENIZERS))
                raise TokenizerError(
                    f"unsupported pre-tokenizer type tokenizer.ggml.pre={self.pre!r} "
                    f"(supported: {supported})"
                )
            self._spec = spec
            self.add_space_prefix = False
            self.clean_spaces = spec.clean_spaces
            self.add_bos = spec.default_add_bos
            self.add_eos = False
            bos: int | None = 11  # llama.cpp's defaults for BPE vocabularies
            eos: int | None = 11
            unk: int | None = None
        elif self.model == "llama":
            self._is_bpe = False
            self.pre = "default"
            self.add_space_prefix = True
            self.clean_spaces = False
            self.add_bos = True
            self.add_eos = False
            bos, eos, unk = 1, 2, 0
        else:
            raise TokenizerError(
                f"unsupported tokenizer model tokenizer.ggml.model={self.model!r} "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
            )
        return bos, eos, unk

    def _vocabulary(self, tokens: Sequence[Any], get: Callable[..., Any]) -> int:
        """Tokens, scores, types and (BPE) merge ranks; the vocabulary's size."""

        # -- vocabulary
        self._tokens: list[str] = [
            str(t) if t != "" else f"[EMPTY_{i}]" for i, t in enumerate(tokens)
        ]
        n = len(self._tokens)
        self.vocab_size = n
        self._token_to_id: dict[str, int] = {}
        for i, t in enumerate(self._tokens):
            if self._token_to_id.setdefault(t, i) != i:
                raise TokenizerError(
                    f"duplicate token in vocabulary: {t!r} has ids {self._token_to_id[t]} and {i}"
                )
        scores = get(Keys.Tokenizer.SCORES)
        self._scores: list[float] = [float(s) for s in scores] if scores is not None else [0.0] * n
        if len(self._scores) < n:
            raise TokenizerError(f"tokenizer.ggml.scores has {len(self._scores)} < {n} entries")
        types = get(Keys.Tokenizer.TOKEN_TYPE)
        if types is not None and len(types) < n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} < {n} entries")
        self._attrs: list[int] = (
            [_TYPE_TO_ATTR.get(int(t), 0) for t in types[:n]]
            if types is not None
            else [_NORMAL] * n
        )

        # -- BPE merges: "left right" -> rank (first occurrence wins, as in llama.cpp)
        self._ranks: dict[str, int] = {}
        if self._is_bpe:
            merges = get(Keys.Tokenizer.MERGES)
            if merges is None:
                raise TokenizerError("BPE tokenizer without tokenizer.ggml.merges")
            for rank, merge in enumerate(merges):
                self._ranks.setdefault(str(merge), rank)
        return n

    def _special_ids_of(
        self,
        get: Callable[..., Any],
        n: int,
        bos: int | None,
        eos: int | None,
        unk: int | None,
    ) -> tuple[int | None, int | None, dict[str, int | None]]:
        """BOS, EOS, unknown, and the end-of-turn, end-of-message and fill-in-the-middle
        ids the metadata names; whether BOS and EOS are added."""

        # -- special ids (metadata overrides defaults; out-of-range values are ignored)
        def special(key: str, default: int | None) -> int | None:
            if default is not None and default >= n:
                default = None
            value = get(f"tokenizer.ggml.{key}")
            if value is None:
                return default
            value = int(value)
            return value if 0 <= value < n else default

        self.bos_token_id = special("bos_token_id", bos)
        self.eos_token_id = special("eos_token_id", eos)
        self.unk_token_id = special("unknown_token_id", unk)
        eot = special("eot_token_id", None)
        eom = special("eom_token_id", None)
        fim = {k: special(f"fim_{k}_token_id", None) for k in _FIM_TEXTS}
        for k, legacy in (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle")):
            fim[k] = special(f"{legacy}_token_id", fim[k])
        self.add_bos = bool(get(Keys.Tokenizer.ADD_BOS, self.add_bos))
        self.add_eos = bool(get(Keys.Tokenizer.ADD_EOS, self.add_eos))
        if self.add_bos and self.bos_token_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true but there is no BOS token")
        if self.add_eos and self.eos_token_id is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true but there is no EOS token")
        return eot, eom, fim

    def _end_of_generation(
        self, eot: int | None, eom: int | None, fim: dict[str, int | None]
    ) -> None:
        """llama.cpp's end-of-generation set, with the special tokens it finds by text."""
        # -- llama.cpp's detection of special tokens by their text
        if eot is None:
            eot = self._find_and_mark_control(_EOT_TEXTS)
        if eom is None:
            eom = self._find_and_mark_control(_EOM_TEXTS)
        for k, texts in _FIM_TEXTS.items():
            if fim[k] is None:
                fim[k] = self._find_and_mark_control(texts)
        self.eot_token_id = eot
        eog: set[int] = {i for i in (fim["pad"], fim["rep"], fim["sep"]) if i is not None}
        for i, text in enumerate(self._tokens):
            if text in _EOG_TEXTS:
                eog.add(i)
                self._attrs[i] |= _CONTROL
        for i, text in enumerate(self._tokens):
            if text in _ALWAYS_RENDERED:
                self._attrs[i] = _USER_DEFINED
        eog.update(i for i in (self.eos_token_id, eot, eom) if i is not None)
        by_text = {self._tokens[i]: i for i in eog}
        if {"<|return|>", "<|call|>", "<|end|>"} <= by_text.keys() or {
            "<|calls|>",
            "<|flush|>",
            "<|end|>",
        } <= by_text.keys():
            eog.discard(by_text["<|end|>"])
            self._attrs[by_text["<|end|>"]] = _USER_DEFINED
        if {"<|tool_response>", "</s>"} <= by_text.keys():
            eog.discard(by_text["</s>"])
            self._attrs[by_text["</s>"]] = _NORMAL
        self.eog_token_ids = frozenset(eog)

    def _find_and_mark_control(self, texts: Iterable[str]) -> int | None:
        """First token (by id) whose text is one of `texts`; llama.cpp forces it to CONTROL."""
        found = sorted(self._token_to_id[t] for t in texts if t in self._token_to_id)
        if not found:
            return None
        self._attrs[found[0]] |= _CONTROL
        return found[0]

    def _piece(self, token_id: int, *, special: bool) -> bytes:
        attr = self._attrs[token_id]
        text = self._tokens[token_id]
        if attr & (_UNKNOWN | _CONTROL) and not special:
            return b""
        if attr & (_UNKNOWN | _CONTROL | _USER_DEFINED):
            return text.encode()
        if attr & _NORMAL:
            if self._is_bpe:
                return _byte_level_decode(text)
            return text.replace(_SPM_SPACE, " ").encode()
        if attr & _BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError as e:
                raise TokenizerError(f"byte token {token_id} has malformed text {text!r}") from e
        return b""

    # ---- encoding -----------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids for `text`, as llama.cpp's llama_tokenize(add_special, parse_special).

        `add_special` adds BOS/EOS only where the model's metadata asks for them;
        `parse_special` turns control-token text such as "<|im_start|>" into its id
        (user-defined tokens are always matched, as in llama.cpp).
        """
        out: list[int] = []
        if add_special and self.add_bos:
            assert self.bos_token_id is not None
            out.append(self.bos_token_id)
        fragments = self._partition(text, parse_special)
        if self._is_bpe:
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                else:
                    self._encode_bpe_fragment(fragment, out)
        else:
            prev_special = True
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                    prev_special = True
                else:
                    if self.add_space_prefix and prev_special:
                        fragment = " " + fragment
                    self._encode_spm(fragment.replace(" ", _SPM_SPACE), out)
                    prev_special = False
        if add_special and self.add_eos:
            assert self.eos_token_id is not None
            out.append(self.eos_token_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special-token texts out of `text` (llama.cpp's tokenizer_st_partition)."""
        fragments: list[str | int] = [text] if text else []
        for token_id in self._special_ids:
            if not parse_special and self._attrs[token_id] & (_CONTROL | _UNKNOWN):
                continue
            needle = self._tokens[token_id]
            if needle not in text:
                continue
            result: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or needle not in fragment:
                    result.append(fragment)
                    continue
                for k, part in enumerate(fragment.split(needle)):
                    if k:
                        result.append(token_id)
                    if part:
                        result.append(part)
            fragments = result
        return fragments

    def _encode_bpe_fragment(self, text: str, out: list[int]) -> None:
        assert self._pre_tokenizer is not None
        cache = self._word_cache
        for word in self._pre_tokenizer.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(word)
                if len(cache) >= _WORD_CACHE_LIMIT:
                    cache.clear()
                cache[word] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        encoded = _byte_level_encode(word)
        token_to_id = self._token_to_id
        if self._ignore_merges:
            whole = token_to_id.get(encoded)
            if whole is not None:
                return (whole,)
        symbols = list(encoded)
        if len(symbols) > 1:
            symbols = merge_bpe(symbols, self._ranks)
        ids: list[int] = []
        for symbol in symbols:
            token_id = token_to_id.get(symbol)
            if token_id is not None:
                ids.append(token_id)
                continue
            # llama.cpp looks each UTF-8 byte up as a one-byte token; only ASCII can hit.
            for b in symbol.encode():
                if b < 0x80:
                    byte_id = token_to_id.get(chr(b))
                    if byte_id is not None:
                        ids.append(byte_id)
        return tuple(ids)

    def _encode_spm(self, text: str, out: list[int]) -> None:
        """SentencePiece-style merging by token score, with <0xNN> byte fallback."""
        if not text:
            return
        token_to_id = self._token_to_id
        for piece in merge_spm(text, token_to_id, self._scores):
            token_id = token_to_id.get(piece)
            if token_id is not None:
                out.append(token_id)
            else:
                for b in piece.encode("utf-8", "surrogatepass"):
                    out.append(self._byte_token(b))

    def _byte_token(self, b: int) -> int:
        token_id = self._token_to_id.get(f"<0x{b:02X}>")
        if token_id is None and b < 0x80:
            token_id = self._token_to_id.get(chr(b))
        if token_id is None:
            raise TokenizerError(f"vocabulary has no byte-fallback token for byte 0x{b:02X}")
        return token_id

    # ---- decoding -----------------------------------------------------------------

    def token_to_bytes(self, token_id: int, special: bool = False) -> bytes:
        """Raw bytes of one token (llama.cpp token_to_piece; control tokens are b"" unless special)."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} out of range [0, {self.vocab_size})")
        return self._pieces_special[token_id] if special else self._pieces[token_id]

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of a token (e.g. "Ġthe", "<|im_end|>")."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} out of range [0, {self.vocab_size})")
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        """Id of the token whose vocabulary string is exactly `text`, if any."""
        return self._token_to_id.get(text)

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        """Text for `ids`, as llama.cpp's llama_detokenize(remove_special=False, unparse_special=special).

        Control tokens render as nothing unless `special`; SentencePiece vocabularies drop
        the leading space of the first token; invalid UTF-8 becomes U+FFFD.
        """
        data = bytearray()
        for k, token_id in enumerate(ids):
            piece = self.token_to_bytes(token_id, special)
            if k == 0 and self.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            data += piece
        raw = bytes(data)
        if self.clean_spaces:
            raw = _clean_spaces(raw)
        return raw.decode("utf-8", "replace")

    def incremental_decoder(self) -> IncrementalDecoder:
        """A streaming decoder that never splits a UTF-8 character across two deltas."""
        return IncrementalDecoder(self)

    # ---- chat ---------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render the model's own chat template (tokenizer.chat_template) for `messages`.

        The result contains special-token text; encode it with parse_special=True.
        """
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template (tokenizer.chat_template)")
        try:
            return render_chat_template(
                self.chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._tokens[self.bos_token_id] if self.bos_token_id is not None else "",
                eos_token=self._tokens[self.eos_token_id] if self.eos_token_id is not None else "",
            )
        except ChatTemplateError as e:
            raise TokenizerError(str(e)) from e
