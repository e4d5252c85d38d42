"""Expert parallelism over 2 and 4 gloo processes against the single-process model on the same weights."""
import pytest
import torch

from ep_ranks import CONFIG, compare_backends, placement, run_ranks, train_toy
from moe_rl_eks.core.ep_backends import UnsupportedBackend
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.checkpoint import load_hf
from moe_rl_eks.workloads.moe.dispatch import source_major_to_expert_major

SCENARIOS = ("random", "skewed", "rank_sends_none", "packed_recomputed")


def assert_same(results, scenario, backend, reference="local", atol=1e-5):
    got, want = results[scenario, backend], results[scenario, reference]
    for rank, (g, w) in enumerate(zip(got["logits"], want["logits"])):
        torch.testing.assert_close(g, w, atol=atol, rtol=1e-4, msg=lambda m: f"{scenario} rank {rank} logits: {m}")
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
    assert got["grads"].keys() == want["grads"].keys()
    for name in want["grads"]:
        torch.testing.assert_close(got["grads"][name], want["grads"][name], atol=atol, rtol=1e-3,
                                   msg=lambda m: f"{scenario} grad {name}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_alltoall_ep_equals_single_process_outputs_loss_and_grads(world):
    results = run_ranks(world, compare_backends, ("local", "alltoall"), "cpu", "float32", SCENARIOS)
    for scenario in SCENARIOS:
        assert_same(results, scenario, "alltoall")
    skewed = results["skewed", "local"]["grads"]["model.layers.0.mlp.experts.down_proj"]
    assert skewed[2:].abs().sum() == 0 and skewed[:2].abs().sum() > 0  # experts that got nothing
    assert results["rank_sends_none", "alltoall"]["logits"][world - 1].shape[0] == 0


def test_alltoall_ep_under_bf16_autocast_equals_the_single_process_model_under_it():
    # The GPU trainer's mixed precision: float32 master weights, bf16 tokens through the dispatcher and experts.
    results = run_ranks(2, compare_backends, ("local", "alltoall"), "cpu", "bf16-autocast", ("random",))
    got, want = results["random", "alltoall"], results["random", "local"]
    for g, w in zip(got["logits"], want["logits"]):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-2)
    for name, w in want["grads"].items():
        assert got["grads"][name].dtype == torch.float32
        assert torch.cosine_similarity(got["grads"][name].flatten(), w.flatten(), 0) > 0.99, name


def test_ep2_training_lowers_the_loss_and_rank_0_gathers_a_full_hf_checkpoint(tmp_path):
    result = run_ranks(2, train_toy, 30, str(tmp_path))
    losses = result["losses"]
    assert result["backend"] == "alltoall"
    assert losses[-1] < 0.5 * losses[0], losses
    config, state = load_hf(tmp_path)
    assert config == CONFIG
    assert torch.equal(state["model.layers.0.mlp.experts.down_proj"][4:], result["rank1_down_proj"])
    bf16 = result["bf16_down_proj"]  # gathered in the serving dtype
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, state["model.layers.0.mlp.experts.down_proj"].bfloat16())
    model = MoETransformer(config)
    model.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(model(result["ids"][:, :-1]).logits, result["logits"], atol=1e-5, rtol=1e-4)


def test_placement_shares_cuda0_over_gloo_or_gives_each_rank_its_own_gpu_over_nccl():
    # The GPU tests' rank placement (test_deepep_gpu.py), decided the same way on this CPU.
    assert placement(3, 4, "shared", 0) == ("gloo", None)
    assert placement(3, 4, "shared", 1) == ("gloo", torch.device("cuda", 0))
    # CUDA tensors over NCCL; a CPU tensor (a decode loop's agreement flag) over gloo, as the trainer's group does
    assert [placement(r, 8, "per_gpu", 8) for r in (0, 7)] == [("cpu:gloo,cuda:nccl", torch.device("cuda", 0)),
                                                               ("cpu:gloo,cuda:nccl", torch.device("cuda", 7))]
    with pytest.raises(ValueError, match="mode 'local' is not one of"):
        placement(0, 2, "local", 8)


def test_one_rank_per_gpu_refuses_a_machine_with_fewer_gpus_before_starting_ranks():
    with pytest.raises(ValueError, match=r"'per_gpu' needs one GPU per rank \(4 ranks\), this machine has 0"):
        run_ranks(4, compare_backends, ("alltoall",), "cuda", "float32", ("random",), mode="per_gpu")


def test_received_rows_regroup_by_local_expert():
    counts = torch.tensor([[2, 0, 1], [1, 2, 0]])  # from rank 0: e0 e0 e2; from rank 1: e0 e1 e1
    assert source_major_to_expert_major(counts).tolist() == [0, 1, 3, 4, 5, 2]


def test_deepep_refuses_one_rank_and_cpu_naming_the_constraint():
    from moe_rl_eks.core.ep_backends import Topology, check_backend

    with pytest.raises(UnsupportedBackend, match="needs CUDA GPUs"):
        check_backend("deepep", Topology(nodes=1, ranks_per_node=2, device="cpu", num_experts=8))
    with pytest.raises(UnsupportedBackend, match=r"intranode needs \(2, 4, 8\) ranks, not 3"):
        check_backend("deepep", Topology(nodes=1, ranks_per_node=3, device="cuda", num_experts=9))


def test_deepep_without_deep_ep_says_what_is_missing_and_the_alternative(monkeypatch):
    import sys

    from moe_rl_eks.workloads.moe.deepep import DeepEPUnavailable, make_buffer

    monkeypatch.setitem(sys.modules, "deep_ep", None)  # as on a machine where it is not installed
    with pytest.raises(DeepEPUnavailable, match="needs the deep_ep package.*Use ep_backend: alltoall"):
        make_buffer(None, 7168)
