"""ModelInfo: everything torch-free the router and the engine need to know about one model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelinfo.chat_template import ChatTemplate
from modelinfo.config import ModelConfig, model_config_from_hf
from modelinfo.source import ModelSource, resolve_model, weights_fingerprint
from modelinfo.tokenizer import Tokenizer
from protocol.errors import InvalidRequestError, ModelLoadError


@dataclass(frozen=True)
class ModelInfo:
    """Owns one model's metadata: where its files are, its architecture config, tokenizer,
    chat template (None if the model has none), weights fingerprint (for the KV namespace)
    and the name clients use for it. Built once per process by `load_model_info`.
    """

    source: ModelSource
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    fingerprint: str
    served_name: str
    eos_token_ids: tuple[int, ...]
    """Ids that end generation: the tokenizer's, config.json's and generation_config.json's."""

    @property
    def max_context_len(self) -> int:
        """Most tokens (prompt + generated) one sequence may hold."""
        return self.config.max_position_embeddings

    def require_chat_template(self) -> ChatTemplate:
        """The chat template, or InvalidRequestError for a model without one."""
        if self.chat_template is None:
            raise InvalidRequestError(
                f"model {self.served_name!r} has no chat template, so it cannot serve chat "
                "requests; use the completions endpoint with a plain prompt, or serve a model "
                "folder whose tokenizer_config.json (or chat_template.jinja) defines one"
            )
        return self.chat_template


def load_model_config(spec: str) -> ModelConfig:
    """Only the architecture config of `spec` (no tokenizer, no template): cheap enough
    for `kvserve check` to validate parallel layouts against the model."""
    source = resolve_model(spec)
    if source.kind == "hf":
        return model_config_from_hf(_read_json(source.path / "config.json"))
    from modelinfo.gguf_config import model_config_from_gguf

    return model_config_from_gguf(source.path)


def load_model_info(spec: str, *, served_name: str | None = None) -> ModelInfo:
    """Resolve `spec` (see modelinfo.source) and load its config, tokenizer and template.

    Raises ModelLoadError (or UnsupportedArchitectureError) with what to fix.
    """
    source = resolve_model(spec)
    if source.kind == "hf":
        config, tokenizer, template, extra_eos = _load_hf(source.path)
    else:
        config, tokenizer, template = _load_gguf(source.path)
        extra_eos = ()
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"model {spec!r}: the tokenizer has {tokenizer.vocab_size} token ids but the model "
            f"embeds only vocab_size={config.vocab_size}; the tokenizer does not belong to "
            "these weights"
        )
    eos = (*tokenizer.eos_token_ids, *config.eos_token_ids, *extra_eos)
    return ModelInfo(
        source=source,
        config=config,
        tokenizer=tokenizer,
        chat_template=template,
        fingerprint=weights_fingerprint(source),
        served_name=served_name or source.name,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def _load_hf(
    folder: Path,
) -> tuple[ModelConfig, Tokenizer, ChatTemplate | None, tuple[int, ...]]:
    config = model_config_from_hf(_read_json(folder / "config.json"))
    tokenizer = Tokenizer.from_hf_folder(folder)
    template = ChatTemplate.from_hf_folder(folder, tokenizer.special_tokens)
    generation_config = folder / "generation_config.json"
    extra_eos: tuple[int, ...] = ()
    if generation_config.is_file():
        eos = _read_json(generation_config).get("eos_token_id")
        extra_eos = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
    return config, tokenizer, template, extra_eos


def _load_gguf(path: Path) -> tuple[ModelConfig, Tokenizer, ChatTemplate | None]:
    try:
        from modelinfo.gguf_config import model_config_from_gguf, read_gguf_header
    except ModuleNotFoundError as e:
        if e.name != "modelinfo.gguf_config":
            raise
        raise ModelLoadError(
            "this kvserve build cannot read GGUF model configs (modelinfo.gguf_config is "
            "missing); serve a Hugging Face folder instead"
        ) from None
    # All arrays (vocabulary, merges) are needed here; read once for tokenizer and template.
    metadata = read_gguf_header(path, max_array_len=None).metadata
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    template = ChatTemplate.from_gguf_metadata(metadata, tokenizer.special_tokens)
    return model_config_from_gguf(path), tokenizer, template


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
