"""Record llama.cpp's behaviour for the test suite (run offline; CI never builds llama.cpp).

Needs llama-cpp-python in the venv, built without the AMX kernels that crash here:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      .venv/bin/pip install --no-cache-dir llama-cpp-python

Writes
  tests/node/engine/data/tokenizer_reference.json  token ids, pieces, decode and EOG facts
  tests/node/engine/data/llamacpp_reference.json   greedy generations + decode tokens/s

Usage: .venv/bin/python -m scripts.reference.llamacpp_reference [--model PATH] [--threads N]
       [--skip-generation | --only-generation]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # an offline tool (see README): --help works without it, a run needs it
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
except ImportError:
    llama_cpp = None  # type: ignore[assignment,unused-ignore]

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "engine" / "data"
DEFAULT_MODEL = Path.home() / ".cache/mvp-orchestrator/models/SmolLM2-135M-Instruct.Q4_1.gguf"

# Strings whose tokenization is recorded with every (add_special, parse_special) combination.
CASES: list[str] = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\n\n\n",
    " \n",
    " \n \n",
    "\r\n",
    "\t\tTabs\tinside\t",
    "Hello",
    "Hello world",
    " Hello world",
    "Hello world ",
    "Hello world   ",
    "   leading spaces",
    "trailing spaces   ",
    "multiple   spaces   between words",
    "I've been 2 3 4  5   6",
    "I've been 'told' he's here, they're fine, we'll see, I'd go, I'm ok, don't.",
    "DON'T SHOUT, I'M HERE, WE'LL, YOU'RE, THEY'VE, HE'D",
    "'s 't 're 've 'm 'll 'd",
    "0",
    "7",
    "12",
    "123",
    "1234",
    "12345678901234567890",
    "3.14159 2,718 1,000,000 -42 +7 1e10 0x1F 0b1010",
    "2024-01-01T12:34:56Z",
    "Version 1.2.3-rc4 costs $19.99 (20% off)",
    "café naïve résumé coöperate Ångström",
    "cafe\u0301 (combining accent)",
    "Привет, мир! Как дела?",
    "Γειά σου Κόσμε",  # noqa: RUF001
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "안녕하세요 세계",
    "日本語のテキストです。",
    "中文测试：你好，世界！",  # noqa: RUF001
    "🙂",
    "Hello 🙂 world 🌍!",
    "👍🏽 👨‍👩‍👧‍👦 🇫🇷 1️⃣ ❤️",
    "🤖🤖🤖",
    "emoji at end 😀",
    "def add(a, b):\n    return a + b\n",
    'if (x != y && z >= 0) { printf("%d\\n", x); }',
    "for i in range(10):\n\tprint(i)  # comment\n",
    '<div class="a">text</div>',
    "SELECT * FROM users WHERE id = 42;",
    "https://example.com/path/to/page?query=1&lang=en#frag",
    "user@example.com",
    "C:\\Users\\name\\file.txt",
    "!!! ??? ... --- ___ *** ### @@@",
    "a.b,c;d:e!f?g",
    "(parentheses) [brackets] {braces} <angles>",
    "x\u00a0y\u3000z\u2028w\u2009v",
    "zero\u200bwidth\u200djoiner",
    "\ufeffBOM at start",
    "private \ue000 use",
    "unassigned \u0378 char",
    "control \x01\x1b chars",
    "\u0085next line",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "<|endoftext|><|endoftext|>",
    "<reponame>x<file_sep>y<filename>z",
    "<|im_start|",
    "im_start|>",
    "<|IM_START|>",
    "a<|im_end|>b",
    "The quick brown fox jumps over the lazy dog.",
    "Hello , world ! It 's a test . I 've seen ' quoted ' text ?",
    "a ' b ' ' c 's 'm 're 've 'll 'd 't x ,y .z ?w !v",
    " , . ? !",
    "Once upon a time",
    "The capital of France is",
]

# Greedy raw completions (32 tokens each): prose, facts, code, letters, lists. The engine's
# fidelity test compares its default path with these, next to HF float32's own agreement
# (scripts/reference/hf_reference.py replays the same prompt ids).
GENERATION_PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "In 1969, the first astronauts",
    "The largest planet in our solar system is",
    "Photosynthesis is the process by which",
    "import numpy as np\n\ndef",
    "SELECT name, email FROM users WHERE",
    "#include <stdio.h>\n\nint main(void) {",
    "Dear Sir or Madam,\n\nI am writing to",
    "The best way to learn a new language is",
    "Here is a list of fruits:\n1. Apple\n2.",
    "The French Revolution began in",
    "To make a cup of tea, first",
]
GENERATION_TOKENS = 32
TOP_LOGITS = 5  # per step: llama.cpp's best ids and logits (margins at divergence points)

FUZZ_ALPHABET = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list(" \t\n\r.,;:!?'\"-_()[]{}<>/\\|@#$%^&*+=~`")
    + ["  ", "   ", " \n", "'s", "'ll", "é", "ü", "ñ", "ß", "日", "本", "語", "한", "Ж"]
    + ["🙂", "🌍", "👍🏽", "👨‍👩‍👧", "\u200b", "\u00a0", "\u3000", "<|im_end|>", "<|im_start|>"]
)


def make_fuzz(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(FUZZ_ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def long_prompt(words: int = 1000) -> str:
    rng = random.Random(7)
    vocab = (
        "the of and to in is was for on that with as by at from it an be this which or are "
        "model token engine pipeline stage worker 2024 3.5 GPU CPU latency throughput, "
        "durable. workflow! activity? retry: (timeout) [queue] {state} naïve café 東京 🙂"
    ).split()
    return " ".join(rng.choice(vocab) for _ in range(words))


def piece(vocab: Any, token: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(512)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:
        raise RuntimeError(f"token {token}: piece longer than {len(buf)} bytes")
    return buf.raw[:n]


def detokenize(vocab: Any, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 4096 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, unparse_special)
    if n < 0:
        raise RuntimeError("detokenize buffer too small")
    return buf.raw[:n]


# pre-tokenizer types recorded on SmolLM's vocabulary re-labelled with another pre type
PRE_VARIANTS = ["default", "gpt-2", "llama-bpe", "qwen2", "starcoder", "stablelm2"]


def spm_vocab() -> dict[str, Any]:
    """A small SentencePiece-style vocabulary (with deliberate score ties)."""
    rng = random.Random(3)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<tool>"]
    types = [2, 3, 3] + [6] * 256 + [4]
    scores = [0.0] * len(tokens)
    singles = [
        "\u2581",
        *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
        *".,!?'-",
    ]
    for i, ch in enumerate(singles):
        tokens.append(ch)
        types.append(1)
        scores.append(-10.0 - 0.01 * i)
    pieces = (
        "\u2581the \u2581a \u2581hello hello ello llo ll \u2581w or ld \u2581world \u2581t he th in "
        "er an on at en es \u2581is \u2581of \u2581and ing ion \u2581in \u2581to \u2581\u2581 "
        "\u2581\u2581\u2581\u2581 \u2581Hello \u2581H el lo wor orld \u2581wor \u2581s \u2581T "
        "The \u2581The test \u2581test ab abc bc cd \u25811 12 123 \u2581x x\u2581 .\u2581"
    ).split()
    for piece in pieces:
        if piece in tokens:
            continue
        tokens.append(piece)
        types.append(1)
        scores.append(round(-rng.uniform(1.0, 6.0), 1))
    return {"tokens": tokens, "scores": scores, "token_type": types}


SPM_CASES = [
    "",
    " ",
    "hello",
    "hello world",
    " hello world",
    "Hello World",
    "hello  world",
    "   leading",
    "trailing   ",
    "The test is a test",
    "abcd abc bc",
    "123 1234 12",
    "x x x",
    "é",
    "naïve café",
    "日本",
    "🙂 emoji",
    "<s>hello",
    "hello</s>",
    "a<tool>b",
    "<tool>",
    "<unk>",
    "tab\there",
    "new\nline",
    "punct. marks, here! ok?",
]


def write_gguf(path: Path, kv: list[tuple[str, Any, Any, Any]]) -> None:
    """Write a tensor-less GGUF with the given (key, value, type, array sub-type) entries."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value, vtype, sub in kv:
        if key in ("general.architecture",):
            continue
        writer.add_key_value(key, value, vtype, sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def copied_kv(model_path: Path, overrides: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    import gguf

    reader = gguf.GGUFReader(str(model_path))
    out = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = overrides.get(key, field.contents())
        out.append((key, value, vtype, sub))
    return out


def llama_hparams_kv(model_path: Path, n_vocab: int) -> list[tuple[str, Any, Any, Any]]:
    return [
        (k, n_vocab if k == "llama.vocab_size" else v, t, s)
        for k, v, t, s in copied_kv(model_path, {})
        if k.startswith("llama.")
    ]


def spm_kv(model_path: Path, vocab: dict[str, Any], add_space_prefix: bool):
    import gguf

    T = gguf.GGUFValueType
    return [
        *llama_hparams_kv(model_path, len(vocab["tokens"])),
        ("tokenizer.ggml.model", "llama", T.STRING, None),
        ("tokenizer.ggml.tokens", vocab["tokens"], T.ARRAY, T.STRING),
        ("tokenizer.ggml.scores", vocab["scores"], T.ARRAY, T.FLOAT32),
        ("tokenizer.ggml.token_type", vocab["token_type"], T.ARRAY, T.INT32),
        ("tokenizer.ggml.bos_token_id", 1, T.UINT32, None),
        ("tokenizer.ggml.eos_token_id", 2, T.UINT32, None),
        ("tokenizer.ggml.unknown_token_id", 0, T.UINT32, None),
        ("tokenizer.ggml.add_bos_token", True, T.BOOL, None),
        ("tokenizer.ggml.add_eos_token", False, T.BOOL, None),
        ("tokenizer.ggml.add_space_prefix", add_space_prefix, T.BOOL, None),
    ]


def variant_reference(model_path: Path, tmp: Path) -> dict[str, Any]:
    """Token ids for SmolLM's vocab under other pre-tokenizer types."""
    texts = CASES + make_fuzz(150, seed=99)
    out: dict[str, Any] = {}
    for pre in PRE_VARIANTS:
        path = tmp / f"variant-{pre}.gguf"
        write_gguf(path, copied_kv(model_path, {"tokenizer.ggml.pre": pre}))
        llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        cases = []
        for t in texts:
            # parse_special only matters where special-token text occurs
            for ps in (False, True) if "<|" in t else (False,):
                ids = list(llm.tokenize(t.encode(), add_bos=False, special=ps))
                # detokenize also exercises llama.cpp's clean_spaces for these pre types
                cases.append(
                    {
                        "text": t,
                        "parse_special": ps,
                        "ids": ids,
                        "detokenize_hex": detokenize(vocab, ids, False, False).hex(),
                    }
                )
        out[pre] = cases
        del llm
    return out


def spm_reference(model_path: Path, tmp: Path) -> dict[str, Any]:
    vocab = spm_vocab()
    rng = random.Random(11)
    alphabet = [*"abcdehlortwxT1234 .,!'", "  ", "é", "日", "🙂", "<s>", "</s>", "<tool>", "\n"]
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25))) for _ in range(150)]
    result: dict[str, Any] = {"vocab": vocab, "runs": {}}
    for add_space_prefix in (True, False):
        path = tmp / f"spm-{add_space_prefix}.gguf"
        write_gguf(path, spm_kv(model_path, vocab, add_space_prefix))
        llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
        v = llama_cpp.llama_model_get_vocab(llm.model)
        cases = []
        for t in SPM_CASES + fuzz:
            for add_special in (True, False):
                for ps in (False, True):
                    ids = list(llm.tokenize(t.encode(), add_bos=add_special, special=ps))
                    cases.append(
                        {
                            "text": t,
                            "add_special": add_special,
                            "parse_special": ps,
                            "ids": ids,
                            "detokenize_hex": detokenize(v, ids, False, False).hex(),
                        }
                    )
        result["runs"][str(add_space_prefix)] = cases
        del llm
    return result


def tokenizer_reference(model_path: Path) -> dict[str, Any]:
    llm = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def tok(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return list(llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    encode_cases = []
    for text in CASES:
        for add_special in (True, False):
            for parse_special in (False, True):
                encode_cases.append(
                    {
                        "text": text,
                        "add_special": add_special,
                        "parse_special": parse_special,
                        "ids": tok(text, add_special, parse_special),
                    }
                )
    fuzz_cases = [
        {"text": t, "add_special": False, "parse_special": ps, "ids": tok(t, False, ps)}
        for i, t in enumerate(make_fuzz(300, seed=1234))
        for ps in ((i % 2 == 0),)
    ]
    long_text = long_prompt()
    long_case = {
        "text": long_text,
        "add_special": False,
        "parse_special": False,
        "ids": tok(long_text, False, False),
    }

    # chat template, rendered the way llama-cpp-python does it
    meta = llm.metadata
    template = meta.get("tokenizer.chat_template")
    bos_id, eos_id = llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)
    bos_text = llama_cpp.llama_vocab_get_text(vocab, bos_id).decode() if bos_id >= 0 else ""
    eos_text = llama_cpp.llama_vocab_get_text(vocab, eos_id).decode() if eos_id >= 0 else ""
    conversations: list[list[Any]] = [
        [{"role": "user", "content": "Hi there!"}],
        [
            {"role": "system", "content": "You are a pirate."},
            {"role": "user", "content": "Where is the treasure?"},
            {"role": "assistant", "content": "Arr, buried on the island."},
            {"role": "user", "content": "Which island? 🏝️"},
        ],
    ]
    chat_cases = []
    if template:
        for messages in conversations:
            for add_gen in (True, False):
                fmt = Jinja2ChatFormatter(
                    template, eos_text, bos_text, add_generation_prompt=add_gen
                )
                prompt = fmt(messages=messages).prompt
                chat_cases.append(
                    {
                        "messages": messages,
                        "add_generation_prompt": add_gen,
                        "prompt": prompt,
                        "ids": tok(prompt, False, True),
                    }
                )

    # token_to_piece for every token: a digest of all of them, plus a readable sample
    def digest(special: bool) -> str:
        h = hashlib.sha256()
        for i in range(n_vocab):
            p = piece(vocab, i, special)
            h.update(len(p).to_bytes(4, "little") + p)
        return h.hexdigest()

    sample_ids = sorted(set(range(300)) | set(random.Random(5).sample(range(n_vocab), 700)))
    pieces = {
        "sha256": digest(False),
        "sha256_special": digest(True),
        "sample": {str(i): piece(vocab, i, False).hex() for i in sample_ids},
        "sample_special": {str(i): piece(vocab, i, True).hex() for i in sample_ids},
    }

    decode_inputs = [
        tok("Hello 🙂 world 🌍! 日本語", False, False),
        tok("<|im_start|>user\nhi<|im_end|>", False, True),
        [1, 4093, 198, 6004, 2, 0],
        [241],
        [241, 115],
        tok("Hello , world ! It 's a test . I 've seen ' quoted ' text ?", False, False),
    ]
    decode_cases = []
    for ids in decode_inputs:
        for unparse in (False, True):
            decode_cases.append(
                {
                    "ids": ids,
                    "special": unparse,
                    "detokenize_hex": detokenize(vocab, ids, False, unparse).hex(),
                    "pieces_hex": b"".join(piece(vocab, i, unparse) for i in ids).hex(),
                }
            )

    eog = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    attrs = {
        str(i): a
        for i in range(n_vocab)
        if (a := int(llama_cpp.llama_vocab_get_attr(vocab, i))) != 4  # 4 = NORMAL
    }
    return {
        "model": model_path.name,
        "llama_cpp_python_version": llama_cpp.__version__,
        "n_vocab": n_vocab,
        "bos": bos_id,
        "eos": eos_id,
        "eot": llama_cpp.llama_vocab_eot(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "eog": eog,
        "non_normal_attrs": attrs,
        "encode": encode_cases,
        "fuzz": fuzz_cases,
        "long": long_case,
        "chat": chat_cases,
        "decode": decode_cases,
        "pieces": pieces,
    }


def greedy_continuation(llm: Any, vocab: Any, prompt: str, n: int) -> tuple[list[int], list[int]]:
    """The prompt's ids (with BOS) and llama.cpp's greedy continuation of it: at most
    ``n`` tokens, ending before an end-of-generation token."""
    prompt_ids = list(llm.tokenize(prompt.encode(), add_bos=True, special=False))
    llm.reset()
    ids: list[int] = []
    for t in llm.generate(
        prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
    ):
        if llama_cpp.llama_vocab_is_eog(vocab, t):
            break
        ids.append(int(t))
        if len(ids) == n:
            break
    return prompt_ids, ids


def step_logits(llm: Any, prompt_ids: list[int], ids: list[int]) -> list[list[list[float]]]:
    """llama.cpp's top ids and logits before each generated token (the prompt, then the
    generated tokens fed back one at a time, as in generation)."""
    import numpy as np

    llm.reset()
    llm.eval(prompt_ids)
    n_vocab = llm.n_vocab()
    steps: list[list[list[float]]] = []
    for token in ids:
        # the last position's logits (Llama.scores stays empty without logits_all)
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()
        best = np.argsort(-logits, kind="stable")[:TOP_LOGITS]
        if int(best[0]) != token:
            raise RuntimeError(f"eval's argmax {int(best[0])} differs from generate's {token}")
        steps.append([[int(i), round(float(logits[i]), 5)] for i in best])
        llm.eval([token])
    return steps


def generation_reference(model_path: Path, n_threads: int) -> dict[str, Any]:
    llm = Llama(
        model_path=str(model_path),
        n_ctx=512,
        seed=0,
        logits_all=False,
        n_threads=n_threads,
        verbose=False,
    )
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    runs = []
    for prompt in GENERATION_PROMPTS:
        prompt_ids, ids = greedy_continuation(llm, vocab, prompt, GENERATION_TOKENS)
        top = step_logits(llm, prompt_ids, ids)
        llm.reset()
        completion = llm.create_completion(
            prompt, max_tokens=GENERATION_TOKENS, temperature=0, top_k=1, repeat_penalty=1.0,
            seed=0,
        )  # fmt: skip
        text = completion["choices"][0]["text"]  # type: ignore[index,unused-ignore]
        runs.append(
            {
                "prompt": prompt,
                "prompt_ids": prompt_ids,
                "ids": ids,
                "text": b"".join(piece(vocab, i, False) for i in ids).decode("utf-8", "replace"),
                "create_completion_text": text,
                "finish_reason": completion["choices"][0]["finish_reason"],  # type: ignore[index,unused-ignore]
                "top_logits": top,
            }
        )

    # decode speed: time n tokens of greedy generation after the prompt is evaluated;
    # repeated because the dev machine is shared (the best run is the least disturbed)
    prompt_ids = list(llm.tokenize(b"Once upon a time", add_bos=True, special=False))
    n_decode = 64
    rates: list[float] = []
    for _ in range(5):
        llm.reset()
        gen = llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        next(gen)  # prompt evaluation + first token
        t0 = time.perf_counter()
        produced = 0
        for _ in gen:
            produced += 1
            if produced == n_decode:
                break
        rates.append(produced / (time.perf_counter() - t0))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "model": model_path.name,
        "llama_cpp_python_version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(),
        "settings": {
            "n_threads": n_threads,
            "n_ctx": 512,
            "seed": 0,
            "temperature": 0,
            "top_k": 1,
            "max_tokens": GENERATION_TOKENS,
            "repeat_penalty": 1.0,
        },
        "generations": runs,
        "decode_benchmark": {
            "n_threads": n_threads,
            "tokens_per_run": n_decode,
            "runs_tokens_per_second": [round(r, 2) for r in rates],
            "tokens_per_second": round(max(rates), 2),
            "median_tokens_per_second": round(sorted(rates)[len(rates) // 2], 2),
            "load_average_1min": load,
            "cpu": platform.processor() or platform.machine(),
            "os_cpu_count": os.cpu_count(),
            "note": "shared 2-core dev machine; indicative only",
        },
    }


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON with one list element per line: small enough to commit, readable in diffs."""
    pad = " " * (indent + 1)
    if isinstance(obj, dict) and any(isinstance(v, (dict, list)) for v in obj.values()):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        items = [pad + json.dumps(v, separators=(",", ":")) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    return json.dumps(obj, separators=(",", ":"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument(
        "--only-generation", action="store_true", help="leave tokenizer_reference.json as it is"
    )
    args = parser.parse_args()
    if llama_cpp is None:
        raise SystemExit(
            "llamacpp_reference: needs llama-cpp-python==0.3.36 (an offline build, see README)"
        )
    DATA.mkdir(parents=True, exist_ok=True)

    if not args.only_generation:
        ref = tokenizer_reference(args.model)
        with tempfile.TemporaryDirectory() as tmp:
            ref["pre_variants"] = variant_reference(args.model, Path(tmp))
            ref["spm"] = spm_reference(args.model, Path(tmp))
        (DATA / "tokenizer_reference.json").write_text(dumps(ref) + "\n")
        print(f"wrote {DATA / 'tokenizer_reference.json'}")
    if not args.skip_generation:
        gen = generation_reference(args.model, args.threads)
        (DATA / "llamacpp_reference.json").write_text(dumps(gen) + "\n")
        print(f"wrote {DATA / 'llamacpp_reference.json'}")


if __name__ == "__main__":
    main()
