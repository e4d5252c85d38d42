"""The `triton` compute backend plugged into the whole model (through the registry, as a run selects it) gives
the same logits and gradients as the `torch` backend on the same weights. CPU, Triton interpreter."""
import pytest
import torch

from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.parallelize import checkpoint_layers

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, rope_theta=10000.0,
            max_position_embeddings=64, dtype="float32")


@pytest.mark.parametrize("router", [dict(), dict(router="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.0)])
def test_model_with_triton_compute_matches_torch_compute(router):
    config = ModelConfig(**TINY, **router)
    torch.manual_seed(0)
    reference = MoETransformer(config, compute="torch")
    triton_model = MoETransformer(config, compute="triton")
    triton_model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 64, (2, 7))
    outputs = []
    for model in (reference, triton_model):
        out = model(ids, return_routing=True)
        out.logits.square().mean().backward()
        outputs.append(out)
    assert all(torch.equal(a, b) for a, b in zip(outputs[0].routing, outputs[1].routing))
    # Interpreter casts truncate instead of rounding (see test_moe_kernels.py), hence the loose gradient bound.
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, atol=1e-3, rtol=1e-3)
    for (name, p_ref), p_tri in zip(reference.named_parameters(), triton_model.parameters()):
        assert p_tri.grad is not None, name
        err = (p_tri.grad - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp_min(1e-12)
        assert err < 2e-2, f"{name}: relative gradient error {err:.3g}"


def test_fused_training_norms_under_autocast_match_the_plain_modules():
    # The trainer's forward (packed sequences, bf16 autocast over float32 weights, save_attention checkpointing):
    # the `triton` backend's fused norms (q/k norm with the rotary embedding) against the plain modules, same model.
    config = ModelConfig(**{**TINY, "num_hidden_layers": 1})
    torch.manual_seed(0)
    model = MoETransformer(config, compute="triton")
    checkpoint_layers(model, "save_attention")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    ids = torch.randint(0, 64, (1, 11))
    norms = [m for m in model.modules() if getattr(m, "fused", None) is not None]
    assert len(norms) == 4 * config.num_hidden_layers  # input, post-attention, q and k norms of every layer
    calls = []
    fused = norms[0].fused
    results = []
    for use_fused in (True, False):
        for m in norms:
            m.fused = (lambda *a, **k: calls.append(1) or fused(*a, **k)) if use_fused else None
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, sequence_lengths=[4, 7], logits=False)
        out.hidden.float().square().mean().backward()
        results.append((out.hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None}))
        if use_fused:  # forward and recomputation, four norms a layer
            assert len(calls) == 2 * 4 * config.num_hidden_layers
    (h_fused, g_fused), (h_plain, g_plain) = results
    torch.testing.assert_close(h_fused, h_plain, atol=3e-2, rtol=3e-2)
    assert g_fused.keys() == g_plain.keys()
    for name, want in g_plain.items():
        err = (g_fused[name] - want).abs().max() / want.abs().max().clamp_min(1e-12)
        assert err < 5e-2, f"{name}: relative gradient error {err:.3g}"
