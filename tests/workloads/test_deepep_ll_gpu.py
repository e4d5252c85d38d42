"""An expert-parallel server's decode over DeepEP's low-latency kernels (`deepep_ll`) on two ranks, sharing cuda:0
over gloo (what one GPU allows; NVSHMEM reaches the other process's buffer peer to peer) and one rank per GPU over
NCCL (skipped without 2 GPUs): every row's tokens equal
the single-GPU engine's and its logprobs agree within bf16 rounding; the all-to-all decode of the same rows and one
MoE layer are measured alongside. Prefill goes over the all-to-all in both. Skipped without CUDA or deep_ep.
The differences measured are printed (run with -s) so a GPU run's record can state them."""
import importlib.util
import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if importlib.util.find_spec("deep_ep") is None:
    pytest.skip("needs the deep_ep package (images/scripts/build_deepep.sh)", allow_module_level=True)

from ep_ranks import one_rank_per_gpu, run_ranks  # noqa: E402
from ll_ranks import serve_both_ways  # noqa: E402

# Measured on one H200 (2026-12-01, workloads/results/h200-deepep-ll-2.log): every logprob bitwise equal to the
# single GPU's with both computes, one MoE layer within 1e-6 of it (torch: DeepEP's combine sums in another order).
# The bounds leave room for that order, no more: a token sent to a wrong expert, or weighted wrongly, moves a logprob
# by tenths.
LOGPROB_TOLERANCE = 1e-3
LAYER_TOLERANCE = 1e-3  # relative to the layer output's largest magnitude


def row_differences(got: dict, want: dict) -> dict:
    assert got.keys() == want.keys()
    tokens_equal = all(got[k][0] == want[k][0] for k in want)
    deltas = [abs(a - b) for k in want for a, b in zip(got[k][1], want[k][1])]
    bitwise = sum(a == b for k in want for a, b in zip(got[k][1], want[k][1]))
    return {"tokens_equal": tokens_equal, "max_abs_logprob_diff": max(deltas), "logprobs": len(deltas),
            "logprobs_bitwise_equal": bitwise}


def layer_difference(got: torch.Tensor, want: torch.Tensor) -> dict:
    err = (got.float() - want.float()).abs()
    return {"max_abs": err.max().item(), "max_magnitude": want.float().abs().max().item(),
            "bitwise_equal_fraction": (got == want).float().mean().item()}


@pytest.mark.parametrize("mode", ["shared", pytest.param("per_gpu", marks=one_rank_per_gpu(2).marks)])
@pytest.mark.parametrize("compute", ["torch", "triton"])
def test_low_latency_decode_on_two_ranks_gives_the_single_gpu_engines_rows(compute, mode):
    # shared: both ranks on cuda:0 over gloo; per_gpu: rank r on cuda:r over NCCL, as a sharded server on an H200 x2
    result = run_ranks(2, serve_both_ways, compute, timeout=300, start_method="spawn", mode=mode)
    assert all(n > 0 for n in result["ll_dispatches"]), result["ll_dispatches"]  # decode went through DeepEP LL
    single = result["single"]
    report = {"compute": compute, "mode": mode, "ll_dispatches_per_rank": result["ll_dispatches"],
              "deepep_ll_vs_single": row_differences(result["deepep_ll"], single),
              "alltoall_vs_single": row_differences(result["alltoall"], single),
              "deepep_ll_vs_alltoall": row_differences(result["deepep_ll"], result["alltoall"]),
              "layer_deepep_ll_vs_single": layer_difference(result["layer"]["deepep_ll"], result["layer"]["single"]),
              "layer_alltoall_vs_single": layer_difference(result["layer"]["alltoall"], result["layer"]["single"]),
              "layer_deepep_ll_vs_alltoall": layer_difference(result["layer"]["deepep_ll"],
                                                              result["layer"]["alltoall"])}
    print("DEEPEP_LL_RESULT", json.dumps(report))
    for name in ("deepep_ll_vs_single", "alltoall_vs_single"):
        assert report[name]["tokens_equal"], (name, report)
        assert report[name]["max_abs_logprob_diff"] <= LOGPROB_TOLERANCE, (name, report)
    layer = report["layer_deepep_ll_vs_single"]
    assert layer["max_abs"] <= LAYER_TOLERANCE * layer["max_magnitude"], report
