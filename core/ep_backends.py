"""Expert-parallel token dispatch backends: their limits, and the rule `auto` uses to pick one.

One place for both, so a run is resolved once against its environment (core.run.resolve_run) and the resolved
backend travels into the manifests (k8s/) and the trainer's logs (workloads/).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EpBackend = Literal["local", "alltoall", "deepep"]
EpBackendChoice = Literal["auto", "local", "alltoall", "deepep"]
# What an expert-parallel rollout server's decode forwards dispatch with (its prefill keeps the all-to-all).
DecodeBackend = Literal["local", "alltoall", "deepep_ll"]

# DeepEP V1 limits (DeepEP README and source; ../shared/REFERENCE.md).
DEEPEP_INTRANODE_RANKS = (2, 4, 8)
DEEPEP_INTERNODE_RANKS = tuple(range(16, 161, 8))
# DeepEP V1's low-latency kernels: the hidden sizes they are compiled for, their top-k bound, and the largest fixed
# tokens-per-rank M its asserts allow with the NVSHMEM QP depth it sets (1024 >= (M + 1) * 2). All ranks hold the
# same M, and M * ranks must be a multiple of 4 (TMA).
DEEPEP_LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
DEEPEP_LL_MAX_TOP_K = 11
DEEPEP_LL_MAX_TOKENS_PER_RANK = 511


@dataclass(frozen=True)
class Topology:
    nodes: int
    ranks_per_node: int
    device: Literal["cpu", "cuda"]
    num_experts: int
    nvlink_domain: int | None = None  # GPUs of a node that share NVLink (catalog); None: not known (CPU)
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # what the tokens travel in (the model's dtype)
    # The image's DeepEP runs between nodes over EFA (run file: deploy.images.deepep_efa); stock DeepEP does not.
    deepep_internode: bool = False

    @property
    def ep_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class AutoRule:
    min_nodes: int
    max_nodes: int
    backend: EpBackend
    why: str


# `auto` on CUDA, first match wins. AWS measured plain NCCL all-to-all matching or beating DeepEP over EFA up to
# ~8 nodes and DeepEP ahead from ~16-32 nodes; inside one node DeepEP's NVLink kernels beat NCCL
# (153/158 GB/s dispatch/combine at EP8 on H800). Between 9 and 15 nodes nothing was measured: stay with NCCL.
AUTO_RULES: tuple[AutoRule, ...] = (
    AutoRule(1, 1, "deepep", "single node: DeepEP intranode NVLink kernels"),
    AutoRule(2, 15, "alltoall", "2-15 nodes over EFA: NCCL all-to-all matches or beats DeepEP (AWS, p5 4 and 8 nodes)"),
    AutoRule(16, 10**6, "deepep", ">= 16 nodes: DeepEP internode wins (AWS, Megatron-Bridge on 32 nodes)"),
)
DEEPEP_INTERNODE_REQUIREMENT = (
    "DeepEP between nodes needs an EFA-capable build in the trainer image (AWS's patched V1 over NVSHMEM's "
    "libfabric transport, or V2 over NCCL GIN; stock DeepEP needs InfiniBand GPU-initiated RDMA) and "
    "deploy.images.deepep_efa: true once the validation job has shown it")


class UnsupportedBackend(ValueError):
    pass


def check_backend(backend: EpBackend, topo: Topology) -> None:
    """Raise UnsupportedBackend naming the constraint that `backend` breaks on `topo`."""
    if topo.num_experts % topo.ep_size:
        raise UnsupportedBackend(
            f"num_experts ({topo.num_experts}) must be divisible by the expert-parallel size ({topo.ep_size})")
    if backend == "local":
        if topo.ep_size != 1:
            raise UnsupportedBackend(f"ep backend 'local' runs one rank, not {topo.ep_size}")
        return
    if topo.ep_size < 2:
        raise UnsupportedBackend(f"ep backend {backend!r} needs at least 2 ranks; use 'local' for 1")
    if backend == "deepep":
        if topo.device != "cuda":
            raise UnsupportedBackend("ep backend 'deepep' needs CUDA GPUs")
        if topo.dtype != "bfloat16":
            raise UnsupportedBackend(f"ep backend 'deepep' moves bfloat16 tokens; the model's dtype is {topo.dtype}")
        if topo.nvlink_domain is not None and topo.nvlink_domain < topo.ranks_per_node:
            raise UnsupportedBackend(
                f"ep backend 'deepep' moves tokens between a node's ranks over NVLink; this node type's GPUs share "
                f"NVLink in groups of {topo.nvlink_domain}, not {topo.ranks_per_node}")
        if topo.nodes == 1 and topo.ranks_per_node not in DEEPEP_INTRANODE_RANKS:
            raise UnsupportedBackend(
                f"ep backend 'deepep' intranode needs {DEEPEP_INTRANODE_RANKS} ranks, not {topo.ranks_per_node}")
        if topo.nodes > 1 and not topo.deepep_internode:
            raise UnsupportedBackend(f"ep backend 'deepep' on {topo.nodes} nodes: {DEEPEP_INTERNODE_REQUIREMENT}")
        if topo.nodes > 1 and (topo.ranks_per_node != 8 or topo.ep_size not in DEEPEP_INTERNODE_RANKS):
            raise UnsupportedBackend(
                f"ep backend 'deepep' internode needs 8 ranks per node and 16 to 160 ranks in multiples of 8, "
                f"not {topo.nodes} nodes x {topo.ranks_per_node}")


def resolve_backend(choice: EpBackendChoice, topo: Topology, *, exact: bool = False) -> tuple[EpBackend, str]:
    """The backend to run and why; `auto` follows AUTO_RULES (gloo/CPU always uses all-to-all). `exact` (the exact
    numerics mode, which refuses `deepep` set by hand: core.run.exact_refusal): `auto` takes the all-to-all, whose
    combine adds a token's expert outputs on its own rank in slot order, as one rank does."""
    if choice != "auto":
        check_backend(choice, topo)
        return choice, "set in the run configuration"
    if topo.ep_size == 1:
        backend, why = "local", "one rank: no expert parallelism"
    elif topo.device == "cpu":
        backend, why = "alltoall", "CPU (gloo): all_to_all_single"
    elif exact:
        backend, why = "alltoall", ("exact numerics: the all-to-all's combine adds a token's expert outputs in slot "
                                    "order on its own rank, as one rank does; DeepEP's adds them in its own order")
    else:
        rule = next(r for r in AUTO_RULES if r.min_nodes <= topo.nodes <= r.max_nodes)
        backend, why = rule.backend, rule.why
        try:
            check_backend(backend, topo)
        except UnsupportedBackend as exc:
            backend, why = "alltoall", f"{rule.why}, but {exc}; falling back to NCCL all-to-all"
    check_backend(backend, topo)
    return backend, why


def ll_tokens_per_rank(rows: int, ranks: int) -> int:
    """DeepEP low-latency's fixed tokens per rank for decode batches of up to `rows` rows a rank: `rows` rounded up
    so that it times `ranks` is a multiple of 4."""
    m = max(1, rows)
    while (m * ranks) % 4:
        m += 1
    return m


def resolve_decode_backend(topo: Topology, *, hidden_size: int, top_k: int, rows_per_rank: int,
                           deepep_importable: bool, exact: bool = False) -> tuple[DecodeBackend, str]:
    """The dispatcher of an expert-parallel server's decode forwards and why: DeepEP's low-latency kernels where
    this topology and model allow them, else the all-to-all (the reason names the first limit that fails).
    `exact` (the exact numerics mode): the all-to-all always, as resolve_backend's `auto` takes it."""
    if topo.ep_size == 1:
        return "local", "one rank: no expert parallelism"
    check_backend("alltoall", topo)

    def refused(why: str) -> tuple[DecodeBackend, str]:
        return "alltoall", f"DeepEP low-latency refused: {why}; decode uses the all-to-all"

    if exact:
        return refused("exact numerics: its combine adds a token's expert outputs in an order of its own, the "
                       "all-to-all's in slot order on the token's own rank, as one rank does")
    if topo.device != "cuda":
        return refused("needs CUDA GPUs (this is a CPU run over gloo)")
    if not deepep_importable:
        return refused("the deep_ep package cannot be imported (images/scripts/build_deepep.sh builds it)")
    if topo.dtype != "bfloat16":
        return refused(f"it moves bfloat16 tokens; the model's dtype is {topo.dtype}")
    if hidden_size not in DEEPEP_LL_HIDDEN:
        return refused(f"hidden_size {hidden_size} is not one of its compiled sizes {DEEPEP_LL_HIDDEN}")
    if top_k > DEEPEP_LL_MAX_TOP_K:
        return refused(f"num_experts_per_tok {top_k} is above its top-k bound {DEEPEP_LL_MAX_TOP_K}")
    m = ll_tokens_per_rank(rows_per_rank, topo.ep_size)
    if m > DEEPEP_LL_MAX_TOKENS_PER_RANK:
        return refused(f"{rows_per_rank} decode rows per rank need {m} tokens per rank, above its "
                       f"{DEEPEP_LL_MAX_TOKENS_PER_RANK} (NVSHMEM QP depth); lower rollout.max_batch_size")
    if topo.nvlink_domain is not None and topo.nvlink_domain < topo.ranks_per_node:
        return refused(f"a node's ranks must share NVLink (PCIe peers break its memory ordering); this node type's "
                       f"GPUs share NVLink in groups of {topo.nvlink_domain}, not {topo.ranks_per_node}")
    if topo.nodes > 1 and not topo.deepep_internode:
        return refused(f"{topo.nodes} nodes: {DEEPEP_INTERNODE_REQUIREMENT}")
    return "deepep_ll", (f"DeepEP low-latency kernels: {topo.ep_size} ranks, up to {m} tokens per rank, "
                         f"hidden {hidden_size}, top-{top_k}")
