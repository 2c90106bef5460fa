"""kvserve-edge's OutputText (edge/src/detok.rs) against the router's RequestOutputText:
for the same tokens fed in the same extend() calls, the same text delta by delta, the
same finish reasons and token counts, and the same final text. Random cases mix split
characters (tokens that end inside a UTF-8 character), special tokens, ids outside the
vocabulary, EOS and stop ids, stop strings (held back across calls, completed by the
flush), min_tokens, max_tokens, skip_special_tokens on and off, and prompts that end
inside a character (the window path)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from modelinfo.detokenizer import RequestOutputText
from modelinfo.tokenizer import Tokenizer
from protocol.sampling import SamplingParams
from router.edge_tokenizer import write_tokenizer_json

SMOLLM2 = "builtin:smollm2-135m-instruct"
EOS = 2  # <|im_end|>
_TEXTS = ["Hello world", "###END", "ok 🦙🦙 done", "中文字符", "stop here\n\nUser:", "a b c"]
_STOPS = ["###", "END", "\n\n", " world", "🦙", "o", "ab", "中", "User:"]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    from modelinfo.info import load_model_info

    return load_model_info(SMOLLM2).tokenizer


@pytest.fixture(scope="module")
def smollm2_json(smollm2: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("edge-detok") / "tokenizer.json"
    write_tokenizer_json(smollm2, path)
    return path


class CaseMaker:
    """Random detok cases over one tokenizer's vocabulary (seeded)."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        table = tokenizer.token_bytes
        assert table is not None
        self.tokenizer = tokenizer
        self.n = len(table.table)
        self.broken = [
            i for i in range(self.n) if "\ufffd" in table.table[i].decode("utf-8", "replace")
        ]
        self.special = sorted(table.special)
        self.rng = random.Random(seed)

    def ids(self, k: int) -> list[int]:
        rng, out = self.rng, []
        for _ in range(k):
            r = rng.random()
            if r < 0.15:
                out.append(rng.choice(self.broken))
            elif r < 0.2:
                out.append(rng.choice(self.special))
            elif r < 0.5:
                text = rng.choice(_TEXTS)
                out.extend(self.tokenizer.encode(text, add_special_tokens=False)[:3])
            elif r < 0.52:
                out.append(self.n + rng.randrange(10))  # outside the vocabulary
            else:
                out.append(rng.randrange(self.n))
        return out

    def stops(self) -> list[str]:
        rng, stops = self.rng, []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.5:
                source = self.tokenizer.decode(
                    self.ids(rng.randint(1, 3)), skip_special_tokens=False
                )
            else:
                source = rng.choice(_STOPS)
            if source:
                stops.append(source[: rng.randint(1, 6)])
        return stops

    def case(self) -> dict[str, Any]:
        rng = self.rng
        max_tokens = rng.randint(1, 50)
        params: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": rng.randint(0, max_tokens) if rng.random() < 0.3 else 0,
            "stop": self.stops() if rng.random() < 0.6 else [],
            "stop_token_ids": [rng.randrange(self.n) for _ in range(rng.randint(0, 2))],
            "ignore_eos": rng.random() < 0.2,
        }
        eos = [EOS] if rng.random() < 0.8 else [EOS, 0]
        ids = self.ids(rng.randint(0, 40))
        for _ in range(rng.randint(0, 2)):  # plant EOS / stop ids
            ids.insert(rng.randint(0, len(ids)), rng.choice(eos + params["stop_token_ids"]))
        prompt = self.ids(rng.randint(0, 8))
        if rng.random() < 0.2:
            prompt.append(rng.choice(self.broken))  # may end inside a character
        calls, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 6)
            calls.append(ids[i : i + k])
            i += k
        return {
            "params": params,
            "eos": eos,
            "prompt": prompt,
            "skip_special_tokens": rng.random() < 0.7,
            "calls": calls,
            "finish": rng.choice(["stop", "length", None]),
        }


def routers(tokenizer: Tokenizer, case: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """RequestOutputText's answer to a case, and whether it decoded by windows."""
    fields: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in case["params"].items()
    }
    params = SamplingParams(**fields)
    out = RequestOutputText(
        tokenizer,
        params,
        case["eos"],
        prompt_token_ids=case["prompt"],
        skip_special_tokens=case["skip_special_tokens"],
    )
    deltas: list[list[Any]] = []
    for call in case["calls"]:
        if out.finish_reason is not None:
            break
        text, finish, taken = out.extend(call)
        deltas.append([text, finish, taken])
    if out.finish_reason is None and case["finish"]:
        delta = out.finish(case["finish"])
        deltas.append([delta.text, delta.finish_reason, 0])
    windows = out.detokenizer._bytes is None
    return {"deltas": deltas, "final": out.output_text}, windows


def drive(edge_bin: Path, path: Path, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [str(edge_bin), "detok", "--tokenizer", str(path)],
        input="\n".join(json.dumps(c) for c in cases),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(answers) == len(cases)
    return answers


def test_random_cases_equal_the_routers_delta_by_delta(
    edge_bin: Path, smollm2: Tokenizer, smollm2_json: Path
) -> None:
    maker = CaseMaker(smollm2, seed=11)
    cases = [maker.case() for _ in range(2500)]
    num_windows = num_stopped_by_string = 0
    for case, answer in zip(cases, drive(edge_bin, smollm2_json, cases), strict=True):
        want, windows = routers(smollm2, case)
        assert answer == want, case
        num_windows += windows
        num_stopped_by_string += bool(case["params"]["stop"]) and any(
            d[1] == "stop" for d in want["deltas"]
        )
    assert num_windows > 20 and num_stopped_by_string > 100  # both paths were exercised


def test_stop_string_held_back_across_calls(
    edge_bin: Path, smollm2: Tokenizer, smollm2_json: Path
) -> None:
    enc = smollm2.encode
    calls = [enc("Hello wor", add_special_tokens=False), enc("ld###", add_special_tokens=False)]
    calls += [enc("END more", add_special_tokens=False)]
    case = {
        "params": {"max_tokens": 100, "stop": ["###END"]},
        "eos": [EOS],
        "prompt": [],
        "skip_special_tokens": True,
        "calls": calls,
        "finish": None,
    }
    (answer,) = drive(edge_bin, smollm2_json, [case])
    assert answer == routers(smollm2, case)[0]
    texts = [d[0] for d in answer["deltas"]]
    assert texts[:2] == ["Hello wor", "ld"] and answer["final"] == "Hello world"
    assert answer["deltas"][-1][1] == "stop"


def test_split_emoji_and_eos(edge_bin: Path, smollm2: Tokenizer, smollm2_json: Path) -> None:
    ids = smollm2.encode("ok 🦙🦙 done", add_special_tokens=False)
    case = {
        "params": {"max_tokens": 100},
        "eos": [EOS],
        "prompt": [1],
        "skip_special_tokens": True,
        "calls": [[i] for i in ids] + [[EOS, 42]],
        "finish": None,
    }
    (answer,) = drive(edge_bin, smollm2_json, [case])
    assert answer == routers(smollm2, case)[0]
    assert "" in [d[0] for d in answer["deltas"]]  # a token ending inside the emoji
    assert answer["final"] == "ok 🦙🦙 done" and answer["deltas"][-1] == ["", "stop", 1]
