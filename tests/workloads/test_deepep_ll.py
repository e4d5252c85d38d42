"""The `deepep_ll` decode dispatcher's parts that run without a GPU: which topologies get DeepEP's low-latency
kernels (and the reason when not), where a sharded server's ranks go, the phase switch, and the conversion of
DeepEP's expert-major packed receive batch into the expert-sorted rows the experts compute on and back. The
packed batches here are laid out as DeepEP's low_latency_dispatch documents them (expert e's first count[e] rows
valid, in blocks per source rank, any order inside a block, junk after); the all-to-all path is the reference.
The kernels themselves run in test_deepep_ll_gpu.py."""
import dataclasses

import pytest
import torch
from ep_ranks import run_ranks
from ll_ranks import SLOTS, phases_seen

from moe_rl_eks.core.ep_backends import (DEEPEP_LL_HIDDEN, Topology, UnsupportedBackend, ll_tokens_per_rank,
                                         resolve_decode_backend)
from moe_rl_eks.workloads.moe.deepep_ll import packed_order, packed_to_sorted, sorted_to_packed
from moe_rl_eks.workloads.moe.dispatch import LocalDispatcher, PhasedDispatcher, source_major_to_expert_major
from moe_rl_eks.workloads.moe.parallel import ExpertParallel, decode_phase
from moe_rl_eks.workloads.moe.torch_compute import TorchCompute
from moe_rl_eks.workloads.rollout.replica import rank_placement

GPU_NODE = Topology(nodes=1, ranks_per_node=2, device="cuda", num_experts=128)
QWEN3 = dict(hidden_size=2048, top_k=8, rows_per_rank=64, deepep_importable=True)


@pytest.mark.parametrize("topo, shape, backend, why", [
    (GPU_NODE, {}, "deepep_ll", "DeepEP low-latency kernels: 2 ranks, up to 64 tokens per rank, hidden 2048, top-8"),
    (dataclasses.replace(GPU_NODE, ranks_per_node=1), {}, "local", "one rank"),
    (dataclasses.replace(GPU_NODE, device="cpu"), {}, "alltoall", "needs CUDA GPUs"),
    (GPU_NODE, {"deepep_importable": False}, "alltoall", "deep_ep package cannot be imported"),
    (dataclasses.replace(GPU_NODE, dtype="float32"), {}, "alltoall", "dtype is float32"),
    (GPU_NODE, {"hidden_size": 1024}, "alltoall", "hidden_size 1024 is not one of its compiled sizes"),
    (GPU_NODE, {"top_k": 12}, "alltoall", "num_experts_per_tok 12 is above its top-k bound 11"),
    (GPU_NODE, {"rows_per_rank": 512}, "alltoall", "512 decode rows per rank need 512 tokens per rank, above its 511"),
    (dataclasses.replace(GPU_NODE, ranks_per_node=8, nvlink_domain=4), {}, "alltoall", "groups of 4, not 8"),
    (dataclasses.replace(GPU_NODE, nodes=2, ranks_per_node=8), {}, "alltoall", "2 nodes: DeepEP between nodes"),
    (dataclasses.replace(GPU_NODE, nodes=2, ranks_per_node=8, deepep_internode=True), {}, "deepep_ll", "16 ranks"),
])
def test_decode_uses_deepep_low_latency_only_where_topology_and_model_allow_and_says_why(topo, shape, backend, why):
    got, reason = resolve_decode_backend(topo, **{**QWEN3, **shape})
    assert got == backend and why in reason, reason
    if backend == "alltoall":
        assert reason.startswith("DeepEP low-latency refused: ") and reason.endswith("decode uses the all-to-all")


def test_a_topology_no_dispatcher_can_serve_is_refused():
    with pytest.raises(UnsupportedBackend, match="num_experts .96. must be divisible by the expert-parallel size .5."):
        resolve_decode_backend(dataclasses.replace(GPU_NODE, ranks_per_node=5, num_experts=96), **QWEN3)


def test_low_latency_tokens_per_rank_times_ranks_is_a_multiple_of_four():
    assert [ll_tokens_per_rank(rows, 2) for rows in (0, 1, 2, 3, 64)] == [2, 2, 2, 4, 64]
    assert [ll_tokens_per_rank(rows, 4) for rows in (1, 3)] == [1, 3]
    assert ll_tokens_per_rank(5, 6) == 6 and 2048 in DEEPEP_LL_HIDDEN


def test_sharded_server_ranks_take_a_gpu_each_over_nccl_or_share_cuda_0_over_gloo():
    assert rank_placement(1, 2, 2)[:2] == ("nccl", torch.device("cuda", 1))
    backend, device, why = rank_placement(1, 2, 1)
    assert (backend, device) == ("gloo", torch.device("cuda", 0)) and "NCCL cannot put two ranks on one GPU" in why
    assert rank_placement(1, 2, 0)[:2] == ("gloo", torch.device("cpu"))


class _Phase:
    decode_phase = ExpertParallel.decode_phase  # the switch itself, without a process group

    def __init__(self):
        self.decoding = False


def test_the_phased_dispatcher_uses_the_decode_dispatcher_only_inside_the_decode_phase():
    compute = TorchCompute()
    prefill, decode, phase = LocalDispatcher(compute, 4), LocalDispatcher(compute, 4), _Phase()
    phased = PhasedDispatcher(phase, prefill, decode)
    x, ids = torch.randn(3, 8), torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.full((3, 2), 0.5)
    assert phased.dispatch(x, weights, ids)[2][0] is prefill
    with decode_phase(phase):
        x_sorted, counts, handle = phased.dispatch(x, weights, ids)
        assert handle[0] is decode
        torch.testing.assert_close(phased.combine(x_sorted, handle), x)  # identity experts: sum of weights x = x
    assert not phase.decoding
    with pytest.raises(RuntimeError), decode_phase(phase):
        raise RuntimeError("a failed decode step")
    assert not phase.decoding and phased.dispatch(x, weights, ids)[2][0] is prefill
    with pytest.raises(ValueError, match="disagree on local experts: 4 vs 2"):
        PhasedDispatcher(phase, prefill, LocalDispatcher(compute, 2))


def test_a_sharded_decoder_sends_decode_forwards_and_only_those_to_the_decode_dispatcher():
    """Rank 0 decodes 3 rows (12 tokens), rank 1 one row (6) then feeds scratch tokens: each takes 11 decode forwards,
    all of them through the decode side (at most SLOTS tokens), and its prefill through the other side."""
    result = run_ranks(2, phases_seen)
    assert len(result["rows"]) == 4
    for rank, seen in enumerate(result["seen"]):
        assert seen["decode"] == [3 if rank == 0 else 1] * (11 * 2), (rank, seen)  # 11 steps x 2 layers
        assert all(n <= SLOTS for n in seen["decode"])
        # one prefill chunk, 2 layers: rank 0's two prompts packed, 5 + 3 tokens (a group shares one), rank 1's 7
        assert seen["prefill"] == [8 if rank == 0 else 7] * 2, (rank, seen)


def test_packed_order_lists_each_experts_valid_rows_in_expert_order():
    counts = torch.tensor([2, 0, 3], dtype=torch.int32)
    assert packed_order(counts, 5, 5).tolist() == [0, 1, 10, 11, 12]
    assert packed_order(torch.zeros(3, dtype=torch.int32), 5, 0).tolist() == []


RANKS, EXPERTS, HIDDEN, TOP_K = 2, 8, 16, 3
LOCAL = EXPERTS // RANKS


def _rank_batches(scenario: str, tokens=(5, 3)):
    gen = torch.Generator().manual_seed(7)
    batches = []
    for t in tokens:
        x = torch.randn(t, HIDDEN, generator=gen)
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(t)])
        if scenario == "all_to_rank_0":  # rank 1's experts receive nothing
            ids = ids % LOCAL
        weights = torch.rand(t, TOP_K, generator=gen)
        batches.append((x, weights, ids))
    return batches


def _low_latency_layout(batches, rank: int, tokens_per_rank: int, shuffle: bool):
    """What low_latency_dispatch hands `rank`: packed [LOCAL, RANKS * tokens_per_rank, HIDDEN] (junk where no token
    is), counts [LOCAL] int32, and for the test's combine each valid row's (source rank, token, slot)."""
    gen = torch.Generator().manual_seed(rank)
    packed = torch.full((LOCAL, RANKS * tokens_per_rank, HIDDEN), float("nan"))
    counts = torch.zeros(LOCAL, dtype=torch.int32)
    source = {}
    for e in range(LOCAL):
        expert = rank * LOCAL + e
        for src, (x, _, ids) in enumerate(batches):
            rows = [(t, j) for t in range(ids.shape[0]) for j in range(TOP_K) if ids[t, j] == expert]
            if shuffle:  # DeepEP fills a source rank's block in arrival order
                rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
            for t, j in rows:
                packed[e, counts[e]] = x[t]
                source[e, int(counts[e])] = (src, t, j)
                counts[e] += 1
    return packed, counts, source


def _all_to_all_receive(batches, rank: int):
    """The all-to-all path's expert-sorted batch on `rank`: each source's rows sorted by global expert
    (TorchCompute.permute), the slice owned by `rank` exchanged, regrouped with source_major_to_expert_major."""
    compute, parts, recv_counts = TorchCompute(), [], []
    for x, _, ids in batches:
        x_sorted, counts, _ = compute.permute(x, ids, EXPERTS)
        begin = int(counts[:rank * LOCAL].sum())
        parts.append(x_sorted[begin:begin + int(counts[rank * LOCAL:(rank + 1) * LOCAL].sum())])
        recv_counts.append(counts[rank * LOCAL:(rank + 1) * LOCAL])
    recv_counts = torch.stack(recv_counts)
    return torch.cat(parts)[source_major_to_expert_major(recv_counts)], recv_counts.sum(0)


@pytest.mark.parametrize("scenario", ["random", "all_to_rank_0"])
def test_the_packed_batch_becomes_the_all_to_all_paths_expert_sorted_rows(scenario):
    batches = _rank_batches(scenario)
    for rank in range(RANKS):
        packed, counts, _ = _low_latency_layout(batches, rank, tokens_per_rank=6, shuffle=False)
        x_sorted, got_counts, order = packed_to_sorted(packed, counts)
        want, want_counts = _all_to_all_receive(batches, rank)
        assert torch.equal(got_counts, want_counts) and got_counts.dtype == torch.int64
        assert torch.equal(x_sorted, want)  # same rows, same order: the experts compute exactly what they did
        back = sorted_to_packed(x_sorted, order, packed.shape)
        assert back.is_contiguous() and back.shape == packed.shape
        for e in range(LOCAL):
            assert torch.equal(back[e, :counts[e]], packed[e, :counts[e]])


@pytest.mark.parametrize("scenario", ["random", "all_to_rank_0"])
def test_experts_on_packed_batches_combined_with_the_weights_equal_the_single_process_layer(scenario):
    """Each rank's experts run on its packed batch (shuffled within blocks, as DeepEP's arrival order is), their
    outputs go back into the packed layout, and every source token sums weights x expert output over its slots
    (what low_latency_combine does): the same as one process holding all experts (LocalDispatcher)."""
    compute = TorchCompute()
    gen = torch.Generator().manual_seed(3)
    w13 = torch.randn(EXPERTS, 2 * 4, HIDDEN, generator=gen) / 4
    w2 = torch.randn(EXPERTS, HIDDEN, 4, generator=gen) / 2
    batches = _rank_batches(scenario)
    combined = [torch.zeros(x.shape) for x, _, _ in batches]
    for rank in range(RANKS):
        packed, counts, source = _low_latency_layout(batches, rank, tokens_per_rank=6, shuffle=True)
        x_sorted, counts64, order = packed_to_sorted(packed, counts)
        local = slice(rank * LOCAL, (rank + 1) * LOCAL)
        y = sorted_to_packed(compute.experts(x_sorted, counts64, w13[local], w2[local]), order, packed.shape)
        for (e, pos), (src, t, j) in source.items():
            combined[src][t] += batches[src][1][t, j] * y[e, pos]
    local_dispatch = LocalDispatcher(compute, EXPERTS)
    for (x, weights, ids), got in zip(batches, combined):
        x_sorted, counts, handle = local_dispatch.dispatch(x, weights, ids)
        want = local_dispatch.combine(compute.experts(x_sorted, counts, w13, w2), handle)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
