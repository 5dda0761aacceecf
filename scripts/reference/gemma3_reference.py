"""Record llama.cpp's behaviour on Gemma 3 270M for the test suite (run offline; CI never
builds llama.cpp). Needs llama-cpp-python in the venv (see llamacpp_reference.py).

Writes tests/node/engine/data/gemma3_reference.json:
  tokenizer   ids for a wide string set under every (add_special, parse_special), the
              fuzz set, a long text, decodes, digests of every token's piece, EOG ids
  generations greedy raw completions (32 tokens) with llama.cpp's top logits per step

Usage: .venv/bin/python -m scripts.reference.gemma3_reference [--model PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, too

from scripts.reference.llamacpp_reference import (
    CASES,
    DATA,
    detokenize,
    dumps,
    greedy_continuation,
    long_prompt,
    make_fuzz,
    piece,
)

try:  # an offline tool: --help works without it, a run needs it
    import llama_cpp
    from llama_cpp import Llama
except ImportError:
    llama_cpp = None  # type: ignore[assignment,unused-ignore]

DEFAULT_MODEL = Path.home() / ".cache/mvp-orchestrator/models/gemma-3-270m-q4_k_m.gguf"
OUTPUT = DATA / "gemma3_reference.json"

# Beyond llama_reference's CASES: Gemma's own control tokens, SentencePiece whitespace
# (Gemma keeps runs of spaces and newlines as tokens), digits (split one by one), scripts.
GEMMA_CASES = [
    "<bos>",
    "<eos>",
    "<pad>",
    "<unk>",
    "<mask>",
    "<bos>Hello<eos>",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<unused0><unused1>",
    "[multimodal]",
    "<start_of_turn",
    "end_of_turn>",
    "<START_OF_TURN>",
    "a<end_of_turn>b",
    "\u2581leading escaped space",
    "a\u2581b",
    "    four spaces",
    "        eight spaces then text",
    "x" + " " * 31 + "y",
    "\n\n\n\n\n",
    "\t\t\t\t",
    " \t \n \r ",
    "1 22 333 4444 55555 666666",
    "3.14 2.71828 6.022e23 -0.5",
    "Ünïcödé façade – em—dash … ellipsis “quotes” ‘single’",  # noqa: RUF001
    "Σ∫∂√∞≠≤≥ ±×÷ αβγδ",  # noqa: RUF001
    "ñandú jalapeño Straße Œuvre",
    "中华人民共和国成立于1949年。",
    "東京タワーはとても高いです",
    "한국어 문장입니다.",
    "Tiếng Việt có dấu",
    "עברית מימין לשמאל",
    "ภาษาไทยไม่มีช่องว่าง",
    "🧑‍💻🏳️‍🌈🫠🫶🏿",
    "😀😃😄😁😆😅🤣😂",
    "class Foo(Bar):\n    def __init__(self) -> None:\n        super().__init__()\n",
    'fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!("{v:?}"); }',
    "const f = (a, b) => a ?? b; // nullish",
    "$ curl -sSL https://example.org/install.sh | bash -s -- --yes",
    "http://localhost:8080/api/v1/items?id=7&sort=-name",
    "ftp://user:pass@host.example:21/dir/file.tar.gz",
    '{"key": [1, 2.5, true, null], "nested": {"a": "b"}}',
    "<html><body><p>Hi &amp; bye</p></body></html>",
]

# The prompts of llamacpp_reference.py's GENERATION_PROMPTS (SmolLM2's), so that the fidelity
# table (fidelity.py --model gemma) and hf_reference.py --model gemma cover the same texts.
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
TOP_LOGITS = 5


def tokenizer_facts(llm: Any) -> dict[str, Any]:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def tok(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return list(llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    encode = [
        {"text": t, "add_special": a, "parse_special": p, "ids": tok(t, a, p)}
        for t in CASES + GEMMA_CASES
        for a in (True, False)
        for p in (False, True)
    ]
    fuzz = [
        {
            "text": t,
            "add_special": False,
            "parse_special": i % 2 == 0,
            "ids": tok(t, False, i % 2 == 0),
        }
        for i, t in enumerate(make_fuzz(300, seed=4321))
    ]
    long_text = long_prompt()
    decode_inputs = [
        tok("Hello 🙂 world 🌍! 日本語", False, False),
        tok("<start_of_turn>user\nhi<end_of_turn>", True, True),
        tok("    indented\n\n\tcode", False, False),
        [2, 9259, 1, 0, 3, 106, 107],
        [255968],  # a byte token alone
    ]
    decode = [
        {
            "ids": ids,
            "special": special,
            "detokenize_hex": detokenize(vocab, ids, False, special).hex(),
        }
        for ids in decode_inputs
        for special in (False, True)
    ]

    def digest(special: bool) -> str:
        h = hashlib.sha256()
        for i in range(n_vocab):
            p = piece(vocab, i, special)
            h.update(len(p).to_bytes(4, "little") + p)
        return h.hexdigest()

    sample_ids = sorted(set(range(300)) | set(random.Random(6).sample(range(n_vocab), 500)))
    return {
        "n_vocab": n_vocab,
        "bos": llama_cpp.llama_vocab_bos(vocab),
        "eos": llama_cpp.llama_vocab_eos(vocab),
        "eot": llama_cpp.llama_vocab_eot(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "eog": [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "encode": encode,
        "fuzz": fuzz,
        "long": {"text": long_text, "ids": tok(long_text, True, False)},
        "decode": decode,
        "pieces": {
            "sha256": digest(False),
            "sha256_special": digest(True),
            "sample": {str(i): piece(vocab, i, False).hex() for i in sample_ids},
        },
    }


def generations(llm: Any) -> list[dict[str, Any]]:
    import numpy as np

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llm.n_vocab()
    runs = []
    for prompt in GENERATION_PROMPTS:
        prompt_ids, ids = greedy_continuation(llm, vocab, prompt, GENERATION_TOKENS)
        # llama.cpp's top logits before each generated token, fed back one at a time
        llm.reset()
        llm.eval(prompt_ids)
        top: list[list[list[float]]] = []
        for token in ids:
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()
            best = np.argsort(-logits, kind="stable")[:TOP_LOGITS]
            if int(best[0]) != token:
                raise RuntimeError(f"eval's argmax {int(best[0])} differs from generate's {token}")
            top.append([[int(i), round(float(logits[i]), 5)] for i in best])
            llm.eval([token])
        runs.append(
            {
                "prompt": prompt,
                "prompt_ids": prompt_ids,
                "ids": ids,
                "text": b"".join(piece(vocab, i, False) for i in ids).decode("utf-8", "replace"),
                "top_logits": top,
            }
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if llama_cpp is None:
        raise SystemExit("gemma3_reference: needs llama-cpp-python==0.3.36 (see README)")
    llm = Llama(
        model_path=str(args.model), n_ctx=512, seed=0, n_threads=args.threads, verbose=False
    )
    ref = {
        "model": args.model.name,
        "sha256": hashlib.sha256(args.model.read_bytes()).hexdigest(),
        "llama_cpp_python_version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(),
        "settings": {"n_ctx": 512, "n_threads": args.threads, "greedy_tokens": GENERATION_TOKENS},
        "tokenizer": tokenizer_facts(llm),
        "generations": generations(llm),
    }
    OUTPUT.write_text(dumps(ref) + "\n")
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
