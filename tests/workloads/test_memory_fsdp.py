"""The torch-free memory model (core/memory.py) against the trainer's FSDP layout itself, built per rank on the
meta device: Qwen3-30B-A3B's layer shape at 2 layers (the per-layer sizes that decide the sharding)."""
import pytest

from ep_ranks import run_ranks, sharded_state_bytes
from moe_rl_eks.core import memory
from moe_rl_eks.core.run import ModelConfig

QWEN3_30B_A3B_TWO_LAYERS = ModelConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=2,
                                       num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                       moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                       rope_theta=1e6, max_position_embeddings=4096, dtype="bfloat16")


@pytest.mark.parametrize("world", [2, 4])
def test_the_memory_model_holds_the_fsdp_ranks_parameter_gradient_and_adamw_bytes_within_one_percent(world):
    config = QWEN3_30B_A3B_TWO_LAYERS
    experts = config.routed_expert_parameter_count()
    model = memory.trainer_state(replicated=config.parameter_count() - experts, experts=experts, ranks=world,
                                 fsdp=True)
    measured = run_ranks(world, sharded_state_bytes, config)  # rank 0's
    for kind, real in measured.items():
        assert getattr(model, kind) == pytest.approx(real, rel=0.01), kind
    # what FSDP took off each rank is (1 - 1 / world) of the dense weights: the expert split alone would not
    dense_bytes = (config.parameter_count() - experts) * 4
    replicated = memory.trainer_state(replicated=config.parameter_count() - experts, experts=experts, ranks=world,
                                      fsdp=False)
    saved = replicated.parameter_bytes - measured["parameter_bytes"]
    assert saved == pytest.approx(dense_bytes * (1 - 1 / world), rel=0.01)
