"""On a GPU: the whole model with `compute: triton` against the `torch` backend and a float32 reference, bf16,
forward logits and every gradient. Skipped without CUDA (run on the H200 through the device tool)."""
import pytest
import torch

from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.workloads.model import MoETransformer

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SHAPE = dict(vocab_size=512, hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4, rope_theta=10000.0,
             max_position_embeddings=512)


def _run(config, state, compute, dtype, ids):
    model = MoETransformer(config, compute=compute).to("cuda")
    model.load_state_dict(state)
    model.to(dtype)
    out = model(ids, return_routing=True)
    out.logits.float().square().mean().backward()
    return out, {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("router", [dict(), dict(router="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5)])
def test_triton_model_matches_torch_and_float32_on_gpu(router):
    config = ModelConfig(**SHAPE, **router)
    torch.manual_seed(0)
    state = MoETransformer(config).state_dict()
    ids = torch.randint(0, 512, (4, 256), device="cuda")
    want, want_grads = _run(config, state, "torch", torch.float32, ids)
    for compute in ("torch", "triton"):
        got, grads = _run(config, state, compute, torch.bfloat16, ids)
        err = (got.logits.float() - want.logits).norm() / want.logits.norm()
        assert err < 2e-2, f"{compute} logits: relative error {err:.3g}"
        for name, g in grads.items():
            ref = want_grads[name]
            gerr = (g - ref).norm() / ref.norm().clamp_min(1e-12)
            assert gerr < 5e-2, f"{compute} grad {name}: relative error {gerr:.3g}"
