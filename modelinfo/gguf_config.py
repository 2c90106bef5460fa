"""ModelConfig from a GGUF file's metadata, and the GGUF header reader the engine shares.

Torch-free (the router uses it). We parse the header ourselves instead of with
`gguf.GGUFReader`: the reader builds a numpy view per array element and takes ~3 s on
SmolLM2's 49K-token vocabulary, while skipping arrays we do not need takes milliseconds.

GGUF v2/v3 layout (little-endian):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv ×      (key: str, value_type u32, value)      str = u64 length + utf-8 bytes
    n_tensors × (name: str, n_dims u32, dims u64 × n_dims, ggml_type u32, offset u64)
    padding to general.alignment (default 32) | tensor data (offsets relative to here)

`dims` are in ggml order (innermost first): a [rows, cols] torch matrix has dims (cols, rows).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from modelinfo.config import ModelConfig, RopeScaling
from protocol.errors import ModelLoadError, UnsupportedArchitectureError

GGUF_ARCH_TO_HF = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""general.architecture values kvserve runs, and the Hugging Face class each one is."""

_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
_SCALAR_FORMATS.update({11: "q", 12: "d"})
_STRING, _ARRAY = 8, 9
_FIRST_READ_BYTES = 4 << 20
"""Bytes read before parsing (SmolLM2's header is 2.2 MiB); grown 4x until the header fits."""
_DEFAULT_MAX_ARRAY_LEN = 4096
"""By default arrays longer than this (vocabularies, merges) are skipped (SkippedArray)."""


@dataclass(frozen=True)
class SkippedArray:
    """Placeholder for a long metadata array the header reader did not materialise."""

    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes live in the file, and what they are."""

    name: str
    dims: tuple[int, ...]
    """ggml order, innermost first; the torch shape is reversed(dims)."""
    ggml_type: GGMLQuantizationType
    offset: int
    """Absolute byte offset in the file."""
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata key/values and tensor directory; owns no file handle."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]


class _HeaderCut(EOFError):
    """The bytes read so far end inside the header: read more, or the file is truncated."""


class _Cursor:
    """Bounds-checked little-endian reads over the first bytes of the file."""

    def __init__(self, buf: bytes, max_array_len: int | None) -> None:
        self.buf = buf
        self.pos = 0
        self.max_array_len = max_array_len

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise _HeaderCut("the header ends early")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise _HeaderCut("a string runs past the end of the header")
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, n: int) -> list[str]:
        """An array of `n` strings in one loop (a tokenizer's 49K tokens and merges)."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack_len = struct.Struct("<Q").unpack_from
        for _ in range(n):
            if pos + 8 > end:
                raise _HeaderCut("a string array runs past the end of the header")
            (length,) = unpack_len(buf, pos)
            pos += 8
            if pos + length > end:
                raise _HeaderCut("a string runs past the end of the header")
            out.append(buf[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return out

    def scalars(self, etype: int, n: int) -> list[Any]:
        """An array of `n` numbers of one type, unpacked at once."""
        fmt = f"<{n}{_SCALAR_FORMATS[etype]}"
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _HeaderCut("an array runs past the end of the header")
        values = list(struct.unpack_from(fmt, self.buf, self.pos))
        self.pos += size
        return values

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("I"), self.unpack("Q")
            if self.max_array_len is not None and n > self.max_array_len:
                self.skip_array(etype, n)
                return SkippedArray(n)
            if etype == _STRING:
                return self.strings(n)
            if etype in _SCALAR_FORMATS:
                return self.scalars(etype, n)
            return [self.value(etype) for _ in range(n)]
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.unpack(_SCALAR_FORMATS[vtype])

    def skip_array(self, etype: int, n: int) -> None:
        if etype == _STRING:
            for _ in range(n):
                if self.pos + 8 > len(self.buf):
                    raise _HeaderCut("an array runs past the end of the header")
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        elif etype in _SCALAR_FORMATS:
            self.pos += n * struct.calcsize("<" + _SCALAR_FORMATS[etype])
        else:
            raise ValueError(f"cannot skip an array of value type {etype}")
        if self.pos > len(self.buf):
            raise _HeaderCut("an array runs past the end of the header")


def read_gguf_header(
    path: str | os.PathLike[str], *, max_array_len: int | None = _DEFAULT_MAX_ARRAY_LEN
) -> GGUFHeader:
    """Parse metadata and the tensor directory; ModelLoadError if the file is not a
    complete GGUF v2/v3 file (bad magic, truncated header or truncated tensor data).

    Metadata arrays longer than `max_array_len` come back as SkippedArray (None keeps all:
    the tokenizer's 49K tokens and merges then take ~0.1 s instead of ~3 s in GGUFReader).
    """
    path = os.fspath(path)
    read_len = _FIRST_READ_BYTES
    while True:
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                buf = f.read(min(size, read_len))
        except OSError as e:
            raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from None
        try:
            return _parse(path, buf, size, max_array_len)
        except _HeaderCut as e:
            if len(buf) < size:
                read_len *= 4
                continue
            error: Exception = e
        except (EOFError, ValueError, UnicodeDecodeError, struct.error, OverflowError) as e:
            error = e
        raise ModelLoadError(
            f"{path} is not a valid GGUF file ({error}); it may be truncated or corrupt: "
            "download it again"
        )


def _parse(path: str, buf: bytes, file_size: int, max_array_len: int | None) -> GGUFHeader:
    c = _Cursor(buf, max_array_len)
    if buf[:4] != b"GGUF":
        raise ValueError(f"bad magic {buf[:4]!r}, expected b'GGUF'")
    c.pos = 4
    version = c.unpack("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3; big-endian is not)")
    n_tensors, n_kv = c.unpack("Q"), c.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.unpack("I"))
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.unpack("Q") for _ in range(c.unpack("I")))
        raw.append((name, dims, c.unpack("I"), c.unpack("Q")))
    align = int(metadata.get("general.alignment", 32))
    data_start = (c.pos + align - 1) // align * align
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, type_id, rel in raw:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name} has unknown ggml type id {type_id}") from None
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        nbytes = math.prod(dims) // block_elems * block_bytes
        info = GGUFTensorInfo(name, dims, qtype, data_start + rel, nbytes)
        if info.offset + nbytes > file_size:
            raise EOFError(f"tensor {name} data ends past the end of the file ({file_size} B)")
        tensors[name] = info
    return GGUFHeader(path, metadata, tensors)


def _llama3_rope_from_freqs(freq_factors: list[float], head_dim: int, theta: float) -> RopeScaling:
    """llama.cpp stores Llama 3.1+ RoPE scaling as a `rope_freqs` tensor of per-frequency
    divisors instead of metadata; recover the HF llama3 parameters and check they
    reproduce it (low/high_freq_factor 1/4 and an 8192 original context, as Meta ships)."""
    factor = max(freq_factors)
    scaling = RopeScaling(kind="llama3", factor=factor)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    for i, got in enumerate(freq_factors):
        wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelen < high_wavelen:
            want = 1.0
        elif wavelen > low_wavelen:
            want = factor
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - 1.0) / (4.0 - 1.0)
            want = 1.0 / ((1 - smooth) / factor + smooth)
        if abs(got - want) > 1e-3 * want:
            raise ModelLoadError(
                "rope_freqs tensor does not match Llama 3 RoPE scaling (factor "
                f"{factor}, low/high 1/4, original context 8192); this RoPE variant is unsupported"
            )
    return scaling


def _rope_scaling(header: GGUFHeader, arch: str, head_dim: int, theta: float) -> RopeScaling:
    md = header.metadata
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor", md.get(f"{arch}.rope.scale_linear"))
    if kind is None and factor is not None and factor != 1.0:
        kind = "linear"
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(factor or 1.0))
    if kind not in (None, "none"):
        raise ModelLoadError(
            f"{arch}.rope.scaling.type {kind!r} is not supported; supported: none, linear, "
            "and Llama 3 scaling stored as a rope_freqs tensor"
        )
    info = header.tensors.get("rope_freqs.weight")
    if info is None:
        return RopeScaling()
    if info.ggml_type != GGMLQuantizationType.F32:
        raise ModelLoadError(f"rope_freqs.weight has type {info.ggml_type.name}, expected F32")
    with open(header.path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.nbytes)
    freqs = list(struct.unpack(f"<{info.nbytes // 4}f", data))
    return _llama3_rope_from_freqs(freqs, head_dim, theta)


def _int(md: dict[str, Any], key: str) -> int:
    if key not in md:
        raise ModelLoadError(f"GGUF metadata lacks required key {key!r}")
    return int(md[key])


def model_config_from_gguf(path: str | os.PathLike[str]) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (architecture names mapped to HF classes)."""
    header = read_gguf_header(path)
    md, tensors = header.metadata, header.tensors
    arch = md.get("general.architecture")
    if arch not in GGUF_ARCH_TO_HF:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCH_TO_HF)}"
        )
    hidden = _int(md, f"{arch}.embedding_length")
    num_heads = _int(md, f"{arch}.attention.head_count")
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    tokens = md.get("tokenizer.ggml.tokens")
    embed = tensors.get("token_embd.weight")
    if embed is not None:
        # The embedding's rows are what logits index; the token list may be shorter.
        vocab_size = embed.dims[1]
    elif tokens is not None:
        vocab_size = tokens.length if isinstance(tokens, SkippedArray) else len(tokens)
    else:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor and no token list")
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tok = md.get(f"tokenizer.ggml.{key}")
        if tok is not None and int(tok) not in eos_ids:
            eos_ids.append(int(tok))
    bos = md.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCH_TO_HF[arch],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_int(md, f"{arch}.feed_forward_length"),
        num_layers=_int(md, f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(header, arch, head_dim, theta),
        max_position_embeddings=int(md.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )
