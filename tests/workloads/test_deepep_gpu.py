"""The `deepep` backend against `alltoall` and `local` on the same weights: 2 and 4 ranks sharing cuda:0 over a
gloo group (DeepEP's intranode kernels need 2, 4 or 8 ranks; one GPU is what the device machine lends), in bf16
and as float32 weights under bf16 autocast.
Skipped where deep_ep or CUDA is missing."""
import dataclasses

import pytest
import torch

from ep_ranks import CONFIG, compare_backends, run_ranks

pytest.importorskip("deep_ep")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# Widths DeepEP and torch._grouped_mm align to (hidden * 2 bytes and expert widths multiples of 16 bytes).
GPU_CONFIG = dataclasses.replace(CONFIG, hidden_size=256, moe_intermediate_size=64, dtype="bfloat16")


def assert_close_relative(got, want, tol, what):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= tol * max(scale, 1e-6), f"{what}: max error {err:.3g} vs max magnitude {scale:.3g}"


@pytest.mark.parametrize("scenario", ["random", "skewed", "rank_sends_none"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("precision", ["bfloat16", "bf16-autocast"])  # the rollout model's; the trainer's
def test_deepep_equals_alltoall_and_local_on_shared_gpu(world, scenario, precision):
    results = run_ranks(world, compare_backends, ("local", "alltoall", "deepep"), "cuda", precision, (scenario,),
                        GPU_CONFIG, timeout=240, start_method="spawn")
    deepep = results[scenario, "deepep"]
    for reference in ("alltoall", "local"):
        want = results[scenario, reference]
        for rank, (g, w) in enumerate(zip(deepep["logits"], want["logits"])):
            assert g.shape == w.shape
            if w.numel():
                assert_close_relative(g, w, 2e-2, f"{scenario} rank {rank} logits vs {reference}")
        assert deepep["loss"] == pytest.approx(want["loss"], rel=2e-2)
        for name, w in want["grads"].items():
            assert_close_relative(deepep["grads"][name], w, 5e-2, f"{scenario} grad {name} vs {reference}")
