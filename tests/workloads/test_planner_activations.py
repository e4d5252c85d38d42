"""The planner's count of what a checkpointed layer keeps for its backward (core/planner.py), against the bytes
autograd actually holds: every tensor saved for the backward during a forward, counted once per storage."""
from dataclasses import replace

import pytest
import torch

from moe_rl_eks.core import planner
from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.parallelize import checkpoint_layers

SMALL = ModelConfig(vocab_size=512, hidden_size=192, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=48, moe_intermediate_size=96, num_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=1024, dtype="bfloat16")


def saved_bytes(config: ModelConfig, tokens: int) -> int:
    torch.manual_seed(0)
    model = MoETransformer(config)
    checkpoint_layers(model, "full")
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, sequence_lengths=[tokens], logits=False)
    return total


@pytest.mark.parametrize("hidden", [192, 320])
def test_a_fully_checkpointed_layer_keeps_exactly_what_the_planner_counts(hidden):
    config = replace(SMALL, hidden_size=hidden)
    tokens = 256
    # one layer more is what that layer keeps (the embedding, final norm and rotary tables cancel)
    per_layer = (saved_bytes(replace(config, num_hidden_layers=3), tokens)
                 - saved_bytes(replace(config, num_hidden_layers=2), tokens))
    assert per_layer == tokens * planner.kept_bytes_per_token(config, "full")
