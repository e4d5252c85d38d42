"""Known model shapes by name, as their Hugging Face config.json states them (nothing is downloaded): what
`moerl plan` and the benchmarks name. A checkpoint directory's own config.json is read by core/hf_config.py."""
from __future__ import annotations

from .run import ModelConfig

_QWEN3 = dict(vocab_size=151936, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
              max_position_embeddings=40960, rope_theta=1_000_000.0, router_aux_loss_coef=0.001, dtype="bfloat16")

KNOWN_MODELS: dict[str, ModelConfig] = {
    "qwen3-30b-a3b": ModelConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                 moe_intermediate_size=768, **_QWEN3),
    "qwen3-235b-a22b": ModelConfig(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                                   moe_intermediate_size=1536, **_QWEN3),
}


def known_model(name: str) -> ModelConfig:
    try:
        return KNOWN_MODELS[name.lower()]
    except KeyError:
        raise KeyError(f"model {name!r} is not a known name; known: {', '.join(KNOWN_MODELS)} "
                       "(or give a checkpoint directory with a config.json)") from None
