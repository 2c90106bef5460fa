"""ModelConfig from Hugging Face config.json dicts of both transformers generations."""

from __future__ import annotations

import pytest

from modelinfo.config import model_config_from_hf
from protocol.errors import ModelLoadError

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def test_rope_parameters_of_transformers_5():
    cfg = model_config_from_hf(
        {
            **BASE,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.factor == 8.0


def test_top_level_rope_keys_of_older_configs():
    cfg = model_config_from_hf(
        {**BASE, "rope_theta": 5.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert cfg.rope_theta == 5.0 and cfg.rope_scaling.kind == "linear"


def test_qwen_flags_and_errors():
    q3 = model_config_from_hf({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16})
    assert q3.qk_norm and q3.head_dim == 16
    assert model_config_from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"]}).attention_bias
    with pytest.raises(ModelLoadError, match="rope_scaling type 'longrope'"):
        model_config_from_hf({**BASE, "rope_scaling": {"type": "longrope", "factor": 4.0}})
    with pytest.raises(ModelLoadError, match="lacks required key 'hidden_size'"):
        model_config_from_hf({k: v for k, v in BASE.items() if k != "hidden_size"})
