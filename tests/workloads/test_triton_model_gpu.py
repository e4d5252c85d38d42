"""On a GPU: the whole model with `compute: triton` against the `torch` backend, both in bf16, measured against a
float32 reference on the same weights. Both bf16 runs replay the reference's expert choices: bf16 rounding flips
near-tied top-k selections, which would measure routing luck rather than the kernels (the routing kernel's ids
are checked on their own in kernels/bench.py). Skipped without CUDA (run on the H200 through the device tool)."""
import pytest
import torch

from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.kernels.norm_training import rms_norm_training
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.parallelize import checkpoint_layers
from moe_rl_eks.workloads.model.transformer import RMSNorm

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SHAPE = dict(vocab_size=512, hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4, rope_theta=10000.0,
             max_position_embeddings=512)


def _run(config, state, compute, dtype, ids, replay=None):
    model = MoETransformer(config, compute=compute).to("cuda")
    model.load_state_dict(state)
    model.to(dtype)
    out = model(ids, routing_replay=replay, return_routing=True)
    out.logits.float().square().mean().backward()
    return out.logits.float(), out.routing, {n: p.grad.float() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("router", [dict(), dict(router="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5)])
def test_triton_model_is_as_close_to_float32_as_torch_bf16(router):
    config = ModelConfig(**SHAPE, **router)
    torch.manual_seed(0)
    state = MoETransformer(config).state_dict()
    ids = torch.randint(0, 512, (4, 256), device="cuda")
    want, routing, want_grads = _run(config, state, "torch", torch.float32, ids)
    errors = {}
    for compute in ("torch", "triton"):
        logits, _, grads = _run(config, state, compute, torch.bfloat16, ids, replay=routing)
        errors[compute] = {"logits": _rel(logits, want), **{n: _rel(g, want_grads[n]) for n, g in grads.items()}}
    for name, torch_err in errors["torch"].items():
        triton_err = errors["triton"][name]
        print(f"{name}: torch bf16 {torch_err:.2e}, triton bf16 {triton_err:.2e}")
        assert triton_err < max(1.5 * torch_err, 1e-2), f"{name}: triton {triton_err:.3g} vs torch {torch_err:.3g}"


def test_fused_training_norms_are_as_close_to_float32_as_the_plain_modules():
    # The trainer's forward: packed sequences, bf16 autocast over float32 weights, save_attention checkpointing.
    # The fused training norms (what the `triton` backend's `norm` plugs into every layer: input, post-attention,
    # q and k with the rotary embedding) against the plain modules, both measured against float32 without
    # autocast, same weights and expert choices. The experts stay on the torch backend: this checks the norms,
    # and skips compiling and autotuning the grouped GEMMs.
    config = ModelConfig(**SHAPE)
    torch.manual_seed(0)
    model = MoETransformer(config, compute="torch").to("cuda")
    checkpoint_layers(model, "save_attention")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    norms = [m for m in model.model.layers.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 * config.num_hidden_layers
    ids = torch.randint(0, 512, (1, 1024), device="cuda")

    def run(autocast, fused, replay=None):
        for m in norms:
            m.fused = rms_norm_training if fused else None
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(ids, sequence_lengths=[300, 724], logits=False, routing_replay=replay, return_routing=True)
        out.hidden.float().square().mean().backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        return out, {"hidden": out.hidden.detach().float(), **grads}

    reference, want = run(False, False)
    errors = {}
    for fused in (False, True):
        _, got = run(True, fused, replay=reference.routing)
        errors[fused] = {n: _rel(g, want[n]) for n, g in got.items()}
    for name, plain_err in errors[False].items():
        print(f"{name}: plain bf16 {plain_err:.2e}, fused bf16 {errors[True][name]:.2e}")
    worse = {n: (errors[True][n], e) for n, e in errors[False].items() if errors[True][n] >= max(1.5 * e, 1e-2)}
    assert not worse, f"fused vs plain relative errors: {worse}"
