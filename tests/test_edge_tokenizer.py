"""kvserve-edge's tokenizer (edge/src/tokenizer.rs) against the router's: the same ids as
`modelinfo.tokenizer.Tokenizer.encode` on a few thousand varied texts, both values of
add_special_tokens, for the builtin SmolLM2 and for variants of its tokenizer.json in the
other forms the edge supports (Llama 3 / Qwen 2 / GPT-4o split regexes, ignore_merges, a
BOS/EOS template, a prefix space, added tokens of each kind, every Split behavior); the
same bytes as modelinfo's TokenBytes for the whole vocabulary; and the forms it refuses,
refused by the binary and by router/edge_tokenizer.py alike."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from modelinfo import gguf_tokenizer
from modelinfo.tokenizer import Tokenizer
from router.edge_tokenizer import edge_can_tokenize, unsupported_form, write_tokenizer_json

SMOLLM2 = "builtin:smollm2-135m-instruct"

# Code point ranges assigned since Unicode 6 or earlier, without gaps: the edge's
# Unicode tables and `tokenizers`' agree on them.
_ASSIGNED = [
    (0x21, 0x7E), (0xA1, 0x24F), (0x300, 0x36F), (0x391, 0x3A1), (0x3A3, 0x3C9),
    (0x400, 0x4FF), (0x660, 0x669), (0x2010, 0x2027), (0x3041, 0x3096), (0x30A0, 0x30FF),
    (0x4E00, 0x9FA5), (0xAC00, 0xD7A3), (0xE000, 0xF8FF), (0xFF10, 0xFF19),
    (0x10400, 0x1044F), (0x1D400, 0x1D454), (0x1F600, 0x1F64F),
]  # fmt: skip
_SPACES = "\t\n\r \u00a0\u2003\u3000\x0b\x0c\x85\u2028"
_WORDS = [
    "the", "The", " ", "  ", "\n", "\n\n", "\r\n", "\t", "123", "4", "2024", "3.14159",
    "🦙", "🎉", "中文", "日本語", "'s", "'S", "'ll", "'ve", "ſ", "!!", "...", "Ġ", "hello",
    "World", "é", "naïve", "<", "|", ">", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<file_sep>", "<|im_start", "def ", "return x**2", "    ", "# comment", "{}", "\u200b",
    "'ſ", "'LL", "'Re", "'x", "(x)", "\t\tword", "\r", "١٢٣", "Ⅻ", "x²", "\u3000",
]  # fmt: skip


def corpus(seed: int, n: int) -> list[str]:
    """`n` varied texts (seeded): word soups, random assigned chars and whitespace,
    random bytes decoded with errors="replace", long texts."""
    rng = random.Random(seed)
    texts = ["", " ", "Hello world", "  hello  world  ", "ok 🦙🦙 done", "x\n\n\n  y\t\tz"]
    texts += ["don't I'M we'll THEY'RE", "<|im_start|>user\nHi<|im_end|>\n", "   ", "1234567"]
    for i in range(n - len(texts) - 3):
        kind = i % 3
        if kind == 0:
            texts.append("".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 25))))
        elif kind == 1:
            chars = []
            for _ in range(rng.randint(0, 30)):
                if rng.random() < 0.25:
                    chars.append(rng.choice(_SPACES))
                else:
                    lo, hi = rng.choice(_ASSIGNED)
                    chars.append(chr(rng.randint(lo, hi)))
            texts.append("".join(chars))
        else:
            raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
            texts.append(raw.decode("utf-8", "replace"))
    texts.append("The quick brown fox, it's 3.14. " * 400)
    texts.append(" " * 3000 + "x" + "\n" * 500)
    texts.append("".join(rng.choice(_WORDS) for _ in range(3000)))
    return texts


def _unassigned(text: str) -> bool:
    return any(unicodedata.category(c) == "Cn" for c in text)


def drive(edge_bin: Path, path: Path, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tokenize test driver's answers, one per line."""
    proc = subprocess.run(
        [str(edge_bin), "tokenize", "--tokenizer", str(path)],
        input="\n".join(json.dumps(line) for line in lines),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(answers) == len(lines)
    return answers


def assert_same_ids(
    edge_bin: Path, path: Path, backend: Any, texts: list[str], *, nfc: bool = False
) -> int:
    """Every text, both add_special_tokens values: the edge's ids are the backend's; the
    edge may decline only a text with a char its Unicode tables do not assign (or, under
    an NFC normalizer, one from U+0300 on). Returns how many it declined."""
    lines: list[dict[str, Any]] = [
        {"text": t, "add_special_tokens": add} for t in texts for add in (True, False)
    ]
    declined = 0
    for line, answer in zip(lines, drive(edge_bin, path, lines), strict=True):
        text, add = line["text"], line["add_special_tokens"]
        may_decline = _unassigned(text) or (nfc and any(ord(c) >= 0x300 for c in text))
        if "error" in answer and may_decline:
            declined += 1
            continue
        want = backend.encode(text, add_special_tokens=add).ids
        assert answer.get("ids") == want, (text[:200], add, answer)
    if not nfc:
        assert declined <= len(lines) // 50
    return declined


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    from modelinfo.info import load_model_info

    return load_model_info(SMOLLM2).tokenizer


@pytest.fixture(scope="module")
def smollm2_spec(smollm2: Tokenizer) -> dict[str, Any]:
    return json.loads(smollm2.backend.to_str())


@pytest.fixture(scope="module")
def smollm2_json(smollm2: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("edge-tok") / "tokenizer.json"
    write_tokenizer_json(smollm2, path)
    return path


@pytest.fixture(scope="module")
def tiny_spec(smollm2_spec: dict[str, Any]) -> dict[str, Any]:
    """SmolLM2's tokenizer.json with its first 600 merges only (quick to load: for the
    tests of pre-tokenization forms, where the vocabulary's size does not matter)."""
    spec = copy.deepcopy(smollm2_spec)
    merges = spec["model"]["merges"][:600]
    vocab = {t["content"]: t["id"] for t in spec["added_tokens"]}
    for token in sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(token, len(vocab))
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    spec["model"]["vocab"] = vocab
    spec["model"]["merges"] = merges
    return spec


def _write(tmp_path: Path, spec: dict[str, Any], name: str = "tokenizer.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path


def test_smollm2_ids_equal_the_routers(
    edge_bin: Path, smollm2: Tokenizer, smollm2_json: Path
) -> None:
    assert edge_can_tokenize(smollm2) is None
    texts = corpus(seed=1, n=2500)
    assert_same_ids(edge_bin, smollm2_json, smollm2.backend, texts)
    # the Tokenizer the router holds, not only its backend
    few = texts[:50]
    answers = drive(edge_bin, smollm2_json, [{"text": t, "add_special_tokens": True} for t in few])
    assert [a["ids"] for a in answers] == [smollm2.encode(t) for t in few]


def _split_variant(spec: dict[str, Any], regex: str) -> dict[str, Any]:
    """Llama 3 / Qwen 2 form: Split(regex, Isolated) then ByteLevel without its regex, BOS
    and EOS by a template after a ByteLevel post-processor, ignore_merges."""
    spec = copy.deepcopy(spec)
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }  # fmt: skip
    specials = {
        t: {"id": t, "ids": [i], "tokens": [t]} for t, i in (("<|im_start|>", 1), ("<|im_end|>", 2))
    }
    template = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": specials,
    }
    byte_level = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False}
    spec["post_processor"] = {"type": "Sequence", "processors": [byte_level, template]}
    spec["model"]["ignore_merges"] = True
    return spec


@pytest.mark.parametrize(
    ("regex", "full"),
    [
        (gguf_tokenizer._LLAMA3_SPLIT, True),
        (gguf_tokenizer._QWEN2_SPLIT, False),
        (gguf_tokenizer._GPT4O_SPLIT, False),
        (gguf_tokenizer._TEKKEN_SPLIT, False),
    ],
    ids=["llama3", "qwen2", "gpt4o", "tekken"],
)
def test_split_regex_variants(
    edge_bin: Path,
    smollm2_spec: dict[str, Any],
    tiny_spec: dict[str, Any],
    tmp_path: Path,
    regex: str,
    full: bool,
) -> None:
    spec = _split_variant(smollm2_spec if full else tiny_spec, regex)
    backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
    assert edge_can_tokenize(Tokenizer(backend, {})) is None
    assert_same_ids(edge_bin, _write(tmp_path, spec), backend, corpus(seed=2, n=600))


def test_nfc_normalizer_on_text_it_leaves_unchanged(
    edge_bin: Path, tiny_spec: dict[str, Any], tmp_path: Path
) -> None:
    """Qwen 2's form: an NFC normalizer. The edge gives the ids for text below U+0300
    (NFC leaves it as it is) and declines the rest, e.g. "e" + U+0301, which NFC turns
    into "é"."""
    spec = _split_variant(tiny_spec, gguf_tokenizer._QWEN2_SPLIT)
    spec["normalizer"] = {"type": "NFC"}
    backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
    assert edge_can_tokenize(Tokenizer(backend, {})) is None
    texts = [*corpus(seed=5, n=400), "caf\u00e9 na\u00efve", "cafe\u0301"]
    declined = assert_same_ids(edge_bin, _write(tmp_path, spec), backend, texts, nfc=True)
    assert 0 < declined < 2 * len(texts) - 100  # both add_special_tokens values
    accepted, refused = drive(
        edge_bin,
        tmp_path / "tokenizer.json",
        [{"text": t, "add_special_tokens": False} for t in ("caf\u00e9", "cafe\u0301")],
    )
    assert accepted["ids"] == backend.encode("cafe\u0301", add_special_tokens=False).ids
    assert "NFC" in refused["error"]


def _added(content: str, *, special: bool, normalized: bool, id_: int = 0) -> dict[str, Any]:
    return {
        "id": id_, "content": content, "single_word": False, "lstrip": False,
        "rstrip": False, "normalized": normalized, "special": special,
    }  # fmt: skip


def test_prefix_space_and_added_token_kinds(
    edge_bin: Path, smollm2_spec: dict[str, Any], tmp_path: Path
) -> None:
    """ByteLevel's prefix space (before every piece between added tokens); added tokens
    matched on the raw text before those matched on the normalized one, plain (not
    special) ones, one in the vocabulary, and stored ids that `tokenizers` replaces."""
    spec = copy.deepcopy(smollm2_spec)
    spec["pre_tokenizer"]["add_prefix_space"] = True
    spec["added_tokens"] += [
        _added("Hello", special=False, normalized=True, id_=3),  # in the vocabulary
        _added("lo wor", special=False, normalized=False, id_=21),
        _added("🦙🦙", special=True, normalized=True, id_=7),
        _added("<think>", special=False, normalized=False, id_=90000),
    ]
    texts = [*corpus(seed=3, n=500), "Hello world", "🦙🦙🦙 <think>x</think>", "Hello<think>"]
    backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
    assert_same_ids(edge_bin, _write(tmp_path, spec), backend, texts)


@pytest.mark.parametrize(
    "behavior", ["removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"]
)
@pytest.mark.parametrize("invert", [False, True])
def test_split_behaviors(
    edge_bin: Path, tiny_spec: dict[str, Any], tmp_path: Path, behavior: str, invert: bool
) -> None:
    """Every Split behavior, with a string pattern and a regex, inverted or not, before
    ByteLevel with its own regex."""
    from tokenizers import Regex, pre_tokenizers

    backend = tokenizers.Tokenizer.from_str(json.dumps(tiny_spec))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(" ", behavior=behavior, invert=invert),  # type: ignore[arg-type]
            pre_tokenizers.Split(Regex(r"\d+|,"), behavior=behavior, invert=invert),  # type: ignore[arg-type]
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    spec = json.loads(backend.to_str())
    texts = [*corpus(seed=4, n=150), "a,b,,c 12 34,5", " x  y ", "1,2,3"]
    assert_same_ids(edge_bin, _write(tmp_path, spec), backend, texts)


def test_characters_newer_than_the_edges_tables_are_declined(
    edge_bin: Path, smollm2_json: Path
) -> None:
    """U+138A8 (Egyptian hieroglyph, Unicode 16) is no letter to the edge's regexes: the
    edge declines the text (the router then tokenizes it) rather than risk other ids."""
    lines = [{"text": "abc \U000138a8 def", "add_special_tokens": False}]
    lines.append({"text": "abc \U00013000 def", "add_special_tokens": False})  # Unicode 5.2
    declined, accepted = drive(edge_bin, smollm2_json, lines)
    assert "U+138A8" in declined["error"]
    assert accepted["ids"]


def test_token_bytes_of_the_whole_vocabulary(
    edge_bin: Path, smollm2: Tokenizer, smollm2_json: Path
) -> None:
    table = smollm2.token_bytes
    assert table is not None and table.kind == "byte_level"
    ids = [*range(len(table.table)), len(table.table), 10**6]
    (answer,) = drive(edge_bin, smollm2_json, [{"token_bytes": ids}])
    hex_by_id = answer["bytes_hex"]
    for i, raw in enumerate(table.table):
        assert bytes.fromhex(hex_by_id[i]) == raw, i
    assert hex_by_id[-2:] == [None, None]
    special = {i for i, flag in zip(ids, answer["special"], strict=True) if flag}
    assert special == table.special == set(smollm2.all_special_ids)


def _refusals(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    def changed(path: list[str], value: Any) -> dict[str, Any]:
        out = copy.deepcopy(spec)
        node = out
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return out

    lstrip = copy.deepcopy(spec)
    lstrip["added_tokens"][1]["lstrip"] = True
    return [
        ("normalizer", changed(["normalizer"], {"type": "NFKC"})),
        ("pre_tokenizer", changed(["pre_tokenizer"], {"type": "Metaspace", "replacement": "▁"})),
        ("decoder", changed(["decoder"], {"type": "Metaspace", "replacement": "▁"})),
        ("dropout", changed(["model", "dropout"], 0.1)),
        ("byte_fallback", changed(["model", "byte_fallback"], True)),
        ("continuing_subword_prefix", changed(["model", "continuing_subword_prefix"], "##")),
        ("lstrip", lstrip),
        ("post_processor", changed(["post_processor"], {"type": "BertProcessing"})),
        ("truncation", changed(["truncation"], {"max_length": 8})),
    ]


def test_unsupported_forms_are_refused_by_both(
    edge_bin: Path, tiny_spec: dict[str, Any], tmp_path: Path
) -> None:
    for name, spec in _refusals(tiny_spec):
        path = _write(tmp_path, spec, f"{name}.json")
        proc = subprocess.run(
            [str(edge_bin), "tokenize", "--tokenizer", str(path)],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 1 and name in proc.stderr, (name, proc.stderr)
        reason = unsupported_form(spec)
        assert reason is not None and name in reason, (name, reason)


def test_the_driver_answers_bad_lines_with_errors(edge_bin: Path, smollm2_json: Path) -> None:
    proc = subprocess.run(
        [str(edge_bin), "tokenize", "--tokenizer", str(smollm2_json)],
        input='not json\n{"what": 1}\n{"text": "ok", "add_special_tokens": false}\n',
        capture_output=True,
        text=True,
        timeout=60,
    )
    first, second, third = (json.loads(line) for line in proc.stdout.splitlines())
    assert "error" in first and "error" in second and third["ids"]
