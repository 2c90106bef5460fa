"""kvserve-edge's tokenizer against the router's: time per prompt for five fixed prompts,
after checking that the ids are the same.

    python -m benchmarks.edge_tokenizer [--repeat N] [--variant smollm2|llama3]

Edge: the tokenize driver's bench line (`Tokenizer::try_encode` in a loop, word cache
warm, as on the serving path). Router: `modelinfo.tokenizer.Tokenizer.encode` called from
Python (what router/preprocess.py pays). Reference: `tokenizers`' own Rust encoder without
Python per call (encode_batch of the repeated prompt on one thread, per prompt). "llama3"
is SmolLM2's vocabulary with Llama 3's split regex and ignore_merges.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers starts its pool

import tokenizers

from modelinfo.info import load_model_info
from router.edge_binary import edge_binary
from router.edge_tokenizer import write_tokenizer_json

PROMPTS = {
    "chat, 160 B": (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "What is the capital of France? Answer in one word.<|im_end|>\n<|im_start|>assistant\n"
    ),
    "prose, 1.1 KB": (
        "The quick brown fox jumps over the lazy dog. It's 2024, and we're testing "
        "tokenizers with numbers like 3.14159 and words. "
    )
    * 9,
    "code, 1.6 KB": (
        "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
        "for i in range(10):\n    print(i, fib(i))  # comment\n"
    )
    * 12,
    "CJK + emoji, 1.3 KB": "日本語のテキストと中文字符，还有表情🦙🎉 " * 20,
    "prose, 16 KB": (
        "In the beginning the Universe was created. This has made a lot of people very "
        "angry and been widely regarded as a bad move. "
    )
    * 130,
}


def _variant(spec: dict, name: str) -> dict:  # type: ignore[type-arg]
    if name == "smollm2":
        return spec
    from modelinfo.gguf_tokenizer import _LLAMA3_SPLIT

    split = {
        "type": "Split",
        "pattern": {"Regex": _LLAMA3_SPLIT},
        "behavior": "Isolated",
        "invert": False,
    }
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": False,
    }
    spec = dict(spec, pre_tokenizer={"type": "Sequence", "pretokenizers": [split, byte_level]})
    spec["model"] = dict(spec["model"], ignore_merges=True)
    return spec


def _time_per_call(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--variant", choices=["smollm2", "llama3"], default="smollm2")
    args = parser.parse_args()
    tokenizer = load_model_info("builtin:smollm2-135m-instruct").tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        write_tokenizer_json(tokenizer, path)
        spec = _variant(json.loads(path.read_text()), args.variant)
        path.write_text(json.dumps(spec))
        backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
        lines = [{"text": t, "add_special_tokens": False} for t in PROMPTS.values()]
        lines += [{"bench": [t], "repeat": args.repeat} for t in PROMPTS.values()]
        proc = subprocess.run(
            [str(edge_binary(build=True)), "tokenize", "--tokenizer", str(path)],
            input="\n".join(json.dumps(line) for line in lines),
            capture_output=True,
            text=True,
            check=True,
        )
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    n = len(PROMPTS)
    print(f"variant {args.variant}, {args.repeat} calls a prompt; µs a prompt")
    print("| prompt | tokens | edge | router (Python) | tokenizers' Rust encoder |")
    print("|---|---:|---:|---:|---:|")
    for (name, text), ids, bench in zip(PROMPTS.items(), answers[:n], answers[n:], strict=True):
        want = backend.encode(text, add_special_tokens=False).ids
        assert ids["ids"] == want, f"{name}: the edge's ids differ"
        router = _time_per_call(
            lambda t=text: backend.encode(t, add_special_tokens=False), args.repeat
        )
        batch = [text] * 200
        ceiling = _time_per_call(
            lambda b=batch: backend.encode_batch(b, add_special_tokens=False),
            max(1, args.repeat // 200),
        ) / len(batch)
        edge_us = bench["ns_per_encode"] / 1000
        print(
            f"| {name} | {len(want)} | {edge_us:.1f} | {router * 1e6:.1f} | {ceiling * 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
