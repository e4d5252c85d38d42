import pytest
import torch

from moe_rl_eks.core.run import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, rope_theta=10000.0,
                  max_position_embeddings=128, dtype="float32")
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture(name="tiny_config")
def tiny_config_factory():
    return tiny_config


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(1)
