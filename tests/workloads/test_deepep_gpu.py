"""The `deepep` backend against `alltoall` and `local` on the same weights (outputs, loss, every gradient; random,
skewed and empty-rank routing), in bf16 (the rollout model's) and as float32 weights under bf16 autocast (the
trainer's). Two placements (tests/workloads/ep_ranks.py): 2 and 4 ranks sharing cuda:0 over gloo (what one GPU
allows), and one rank per GPU over NCCL at 2, 4 and 8 ranks (DeepEP's intranode kernels take 2, 4 or 8 ranks),
skipped unless the machine has that many GPUs; there also `alltoall` over NCCL against `local` where deep_ep is not
built. Skipped without CUDA; the deepep tests also without deep_ep."""
import dataclasses
import importlib.util

import pytest
import torch

from ep_ranks import CONFIG, compare_backends, one_rank_per_gpu, run_ranks

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
HAS_DEEP_EP = importlib.util.find_spec("deep_ep") is not None
needs_deep_ep = pytest.mark.skipif(not HAS_DEEP_EP, reason="needs the deep_ep package (images/scripts/build_deepep.sh)")

# Widths DeepEP and torch._grouped_mm align to (hidden * 2 bytes and expert widths multiples of 16 bytes).
GPU_CONFIG = dataclasses.replace(CONFIG, hidden_size=256, moe_intermediate_size=64, dtype="bfloat16")
SCENARIOS = ("random", "skewed", "rank_sends_none")
PRECISIONS = ["bfloat16", "bf16-autocast"]


def assert_close_relative(got, want, tol, what):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= tol * max(scale, 1e-6), f"{what}: max error {err:.3g} vs max magnitude {scale:.3g}"


def assert_matches(results, scenario, backend="deepep", references=("alltoall", "local")):
    got = results[scenario, backend]
    for reference in references:
        want = results[scenario, reference]
        for rank, (g, w) in enumerate(zip(got["logits"], want["logits"], strict=True)):
            assert g.shape == w.shape
            if w.numel():
                assert_close_relative(g, w, 2e-2, f"{scenario} rank {rank} {backend} logits vs {reference}")
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)
        assert got["grads"].keys() == want["grads"].keys()
        for name, w in want["grads"].items():
            assert_close_relative(got["grads"][name], w, 5e-2, f"{scenario} {backend} grad {name} vs {reference}")


@needs_deep_ep
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_deepep_equals_alltoall_and_local_on_shared_gpu(world, scenario, precision):
    results = run_ranks(world, compare_backends, ("local", "alltoall", "deepep"), "cuda", precision, (scenario,),
                        GPU_CONFIG, timeout=240, start_method="spawn")
    assert_matches(results, scenario)


@needs_deep_ep
@pytest.mark.parametrize("world", [one_rank_per_gpu(2), one_rank_per_gpu(4), one_rank_per_gpu(8)])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_deepep_equals_alltoall_and_local_one_rank_per_gpu(world, precision):
    # NCCL moves alltoall's bytes GPU to GPU here; DeepEP's kernels use NVLink between the processes' GPUs.
    results = run_ranks(world, compare_backends, ("local", "alltoall", "deepep"), "cuda", precision, SCENARIOS,
                        GPU_CONFIG, timeout=300, start_method="spawn", mode="per_gpu")
    for scenario in SCENARIOS:
        assert_matches(results, scenario)
        assert_matches(results, scenario, "alltoall", ("local",))


@pytest.mark.skipif(HAS_DEEP_EP, reason="the deepep test above compares alltoall with local in the same run")
@pytest.mark.parametrize("world", [one_rank_per_gpu(2), one_rank_per_gpu(4), one_rank_per_gpu(8)])
def test_alltoall_over_nccl_equals_local_one_rank_per_gpu(world):
    results = run_ranks(world, compare_backends, ("local", "alltoall"), "cuda", "bf16-autocast", SCENARIOS,
                        GPU_CONFIG, timeout=300, start_method="spawn", mode="per_gpu")
    for scenario in SCENARIOS:
        assert_matches(results, scenario, "alltoall", ("local",))
