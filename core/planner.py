"""The trainer-at-scale planner, torch-free: per-GPU memory of a training run on N nodes of an instance type, the
smallest node count that fits, and a predicted step time with the expert traffic over NVLink and EFA. `moerl plan`
prints it; `moerl manifests` refuses a run whose plan does not fit its trainer pool (core/run.py).

Memory comes from core/memory.py (the same model as the local GPU run's fit check); the activations of the
trainer's checkpointed layers are counted from what the model keeps (each layer's float32 input; with
"save_attention" also the attention output and its log-sum-exp), plus one layer's recomputed working set and one
chunk of the logprob head's logits; with FSDP, what it gathers (the root's weights through a micro-batch, two
layers', their unsharded float32 gradients). Context parallelism (Ulysses) splits each micro-batch's tokens over
its ranks. Step time is compute at an achieved fraction of the GPU's dense bf16 peak plus, with no overlap (a
bound from above), the expert all-to-alls over the EP group, Ulysses' all-to-alls and FSDP's all-gathers and
reduce-scatters, at the per-GPU bandwidths published for EFA (../shared/REFERENCE.md; the comparison with
published step times is in docs/benchmarks.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from . import memory
from .catalog import InstanceType

if TYPE_CHECKING:  # core/run.py checks a run against the plan, so the planner does not import it at run time
    from .run import ModelConfig

Checkpointing = Literal["off", "full", "save_attention"]
Backend = Literal["alltoall", "deepep"]
ParamDtype = Literal["float32", "bfloat16"]

# Dense bf16 tensor-core peak per GPU (NVIDIA's specifications, without sparsity), TFLOP/s.
DENSE_BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "B200": 2250.0, "L40S": 362.0}
# Achieved by our trainer on one H200 at the Qwen3-30B-A3B layer shape (8 x 8,192 tokens, save_attention):
# 361 TFLOP/s = 36.5 % of the specification (REFERENCE.md); used for every GPU as a fraction of its peak.
ACHIEVED_FRACTION_OF_PEAK = 0.365
# Per-GPU expert all-to-all bandwidth, GB/s (dispatch and combine alike). Within a node: DeepEP's intranode EP8
# figure (~155 GB/s over NVLink). Across nodes over EFA, p5: NCCL all-to-all 45.1 at 4 nodes and 40.4 at 8;
# DeepEP + NVSHMEM 44.9 and 39.4 (mean of dispatch and combine). Beyond 8 nodes the 8-node figure is used.
NVLINK_GBPS = 155.0
EFA_GBPS = {"alltoall": ((4, 45.1), (8, 40.4)), "deepep": ((4, 44.9), (8, 39.4))}
# One recomputed layer's working set per token, relative to the count below: bench-train on one H200 at the 30B
# shape (8 layers, 65,536 tokens a micro-batch, "full"; workloads/results/h200-bench-train-2.json) peaked 37.1 GiB
# above the weights and AdamW state: 20.9 GiB of float32 gradients, 4.0 GiB of layer inputs, a 2 GiB logits chunk,
# leaving 10.2 GiB = 167 KB per token against the count's 201 KB. ("save_attention" peaked the same there, where
# this model adds the kept attention outputs: 4 GiB, 11 % of that peak, on the safe side.)
WORKING_SET_CALIBRATION = 0.83
LOGITS_CHUNK_BYTES = 2 * 2**30  # the logprob head's bf16 chunk on a GPU (workloads/model/logprobs.py)
BF16 = 2
# What of a GPU's memory the plan may fill: the caching allocator fragments; the rest is headroom.
USABLE_FRACTION = 0.95


@dataclass(frozen=True)
class TrainingShape:
    """What one optimizer step trains: micro-batches of packed tokens, samples `sequence` tokens long on average."""

    microbatch_tokens: int = 8192
    tokens_per_step: int = 512 * 2048
    sequence: int = 2048
    checkpointing: Checkpointing = "save_attention"
    fsdp: bool = True
    reference: bool = False  # a KL reference kept beside the policy
    expert_parallel: int | None = None  # ranks per EP group (None: every rank); fewer shard the experts' copies
    param_dtype: ParamDtype = "float32"  # what FSDP gathers parameters in (rl.training.fsdp_param_dtype)
    context_parallel: int = 1  # consecutive ranks sharing each micro-batch's tokens (rl.training.context_parallel)


@dataclass(frozen=True)
class GpuMemory:
    parameters: int
    gradients: int
    optimizer: int
    reference: int
    activations: int
    gathered: int  # FSDP's gathered weights and unsharded gradients in flight
    overhead: int

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.reference + self.activations
                + self.gathered + self.overhead)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    nvlink_s: float  # the expert and (CP) Ulysses all-to-alls within a node
    efa_s: float  # the expert all-to-alls between nodes
    fsdp_s: float = 0.0  # FSDP's all-gathers and reduce-scatters

    @property
    def total_s(self) -> float:
        return self.compute_s + self.nvlink_s + self.efa_s + self.fsdp_s


@dataclass(frozen=True)
class Plan:
    model: ModelConfig
    instance: InstanceType
    nodes: int
    backend: Backend
    shape: TrainingShape
    memory: GpuMemory
    step: StepTime

    @property
    def ranks(self) -> int:
        return self.nodes * self.instance.gpus

    @property
    def gpu_bytes(self) -> int:
        return self.instance.gpu_memory_mib * 2**20

    @property
    def fits(self) -> bool:
        return self.memory.total <= USABLE_FRACTION * self.gpu_bytes


def layer_working_set_bytes_per_token(m: ModelConfig) -> int:
    """One decoder layer's tensors kept for its backward, per token, as its forward makes them under bf16
    autocast (float32 residual stream and norms): norms' inputs and outputs, q/k/v and their normed, rotated forms,
    the attention output and log-sum-exp, the router's logits and probabilities, and per routed copy the
    dispatched input, the gate/up product, its activation and the expert output."""
    h, q, kv, w, k = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim, \
        m.moe_intermediate_size, m.num_experts_per_tok
    attention = 4 * h + 2 * h + BF16 * (q + 2 * kv) + BF16 * (q + kv) + BF16 * q + 4 * m.num_attention_heads \
        + BF16 * h + 4 * h
    moe = 4 * h + 2 * h + 2 * 4 * m.num_experts + k * (BF16 * h + BF16 * 2 * w + BF16 * w + 4 * h)
    return attention + moe


def kept_bytes_per_token(m: ModelConfig, checkpointing: Checkpointing, residual_bytes: int = 4) -> int:
    """What each layer keeps per token until the backward reaches it (`residual_bytes`: the residual stream's
    dtype, float32 unless FSDP gathers bf16 parameters, whose embedding then makes it bf16)."""
    if checkpointing == "off":
        return layer_working_set_bytes_per_token(m)
    kept = residual_bytes * m.hidden_size  # the layer's input
    if checkpointing == "save_attention":
        kept += BF16 * m.num_attention_heads * m.head_dim + 4 * m.num_attention_heads
    return kept


def activation_bytes(m: ModelConfig, layers: int, tokens: int, checkpointing: Checkpointing,
                     residual_bytes: int = 4) -> int:
    working = 0 if checkpointing == "off" else int(WORKING_SET_CALIBRATION * layer_working_set_bytes_per_token(m))
    return tokens * (layers * kept_bytes_per_token(m, checkpointing, residual_bytes) + working) + LOGITS_CHUNK_BYTES


def param_bytes(shape: TrainingShape) -> int:
    return BF16 if shape.fsdp and shape.param_dtype == "bfloat16" else memory.FP32


@dataclass(frozen=True)
class ShardedParameters:
    """Parameter counts of what FSDP gathers: the root's (embedding, lm_head), one decoder layer's dense ones, and
    one layer's experts of an EP rank (0 where EP spans every rank: FSDP leaves them out)."""

    root: int
    dense_layer: int
    expert_layer: int


def sharded_parameters(m: ModelConfig, ranks: int, shape: TrainingShape) -> ShardedParameters:
    experts = m.routed_expert_parameter_count()
    root = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    dense_layer = (m.parameter_count() - experts - root - m.hidden_size) // m.num_hidden_layers
    ep = shape.expert_parallel or ranks
    return ShardedParameters(root, dense_layer, experts // (m.num_hidden_layers * ep) if ep < ranks else 0)


def gathered_bytes(m: ModelConfig, ranks: int, shape: TrainingShape) -> int:
    """FSDP2's peak of gathered state: the root's weights through each micro-batch's forward and backward, two
    layers' (one computing, the next prefetched), and the root's and one layer's unsharded gradients in float32
    (the reduce dtype) before their reduce-scatter."""
    if not shape.fsdp or ranks == 1:
        return 0
    p = sharded_parameters(m, ranks, shape)
    layer = p.dense_layer + p.expert_layer
    return (p.root + 2 * layer) * param_bytes(shape) + (p.root + layer) * memory.FP32


def gpu_memory(m: ModelConfig, ranks: int, shape: TrainingShape) -> GpuMemory:
    experts = m.routed_expert_parameter_count()
    dense = m.parameter_count() - experts
    state = memory.trainer_state(replicated=dense, experts=experts, ranks=ranks, fsdp=shape.fsdp,
                                 expert_parallel=shape.expert_parallel)
    reference = memory.reference_bytes(replicated=dense, experts=experts, ranks=ranks,
                                       fsdp=shape.fsdp) if shape.reference else 0
    tokens = -(-shape.microbatch_tokens // shape.context_parallel)  # a CP rank's slice of each micro-batch
    return GpuMemory(state.parameter_bytes, state.gradient_bytes, state.optimizer_bytes, reference,
                     activation_bytes(m, m.num_hidden_layers, tokens, shape.checkpointing, param_bytes(shape)),
                     gathered_bytes(m, ranks, shape), memory.CUDA_OVERHEAD_BYTES)


def training_flops_per_token(m: ModelConfig, sequence: int, checkpointing: Checkpointing) -> float:
    """Forward + backward (3x the forward's matmuls), plus the recomputed forward of checkpointed layers: the
    active parameters' products (2 FLOPs each) and causal attention over `sequence`-token samples."""
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    per_layer = 2 * (h * (q + 2 * kv) + q * h + h * m.num_experts
                     + (m.num_experts_per_tok + m.n_shared_experts) * 3 * h * m.moe_intermediate_size) \
        + 2 * q * sequence  # QK and PV, causal: half the square
    head = 2 * h * m.vocab_size
    forwards = 3 + (0 if checkpointing == "off" else 1)
    return forwards * m.num_hidden_layers * per_layer + 3 * head


def efa_gbps(backend: Backend, nodes: int) -> float:
    points = EFA_GBPS[backend]
    for at, gbps in points:
        if nodes <= at:
            return gbps
    return points[-1][1]


def expert_traffic_bytes_per_token(m: ModelConfig, nodes: int, gpus_per_node: int, backend: Backend,
                                   checkpointing: Checkpointing) -> tuple[float, float]:
    """Bytes a token's expert all-to-alls move per GPU in a step, (over NVLink, over EFA), with uniform routing over
    EP = every rank: dispatch and combine of bf16 rows in the forward, again in the backward and in a recomputed
    forward. NCCL all-to-all sends each routed copy; DeepEP sends a token once per destination node over EFA and
    fans it out over NVLink there."""
    k, row = m.num_experts_per_tok, BF16 * m.hidden_size
    passes = 2 * (2 + (0 if checkpointing == "off" else 1))  # (dispatch + combine) x (fwd, bwd[, recompute])
    ranks = nodes * gpus_per_node
    remote_share = (nodes - 1) / nodes
    local_other = (gpus_per_node - 1) / ranks  # a copy to another GPU of the same node
    if backend == "deepep" and nodes > 1:
        remote_nodes = (nodes - 1) * (1 - (1 - 1 / nodes) ** k)  # distinct other nodes a token's experts are on
        efa = remote_nodes * row
        nvlink = k * (local_other + remote_share * (gpus_per_node - 1) / gpus_per_node) * row
    else:
        efa = k * remote_share * row
        nvlink = k * local_other * row
    return passes * nvlink, passes * efa


def plan(m: ModelConfig, instance: InstanceType, nodes: int, *, backend: Backend = "alltoall",
         shape: TrainingShape = TrainingShape()) -> Plan:
    if nodes < 1:
        raise ValueError(f"nodes: {nodes} must be >= 1")
    if instance.gpu_model not in DENSE_BF16_TFLOPS:
        raise ValueError(f"instance type {instance.name}: its GPU ({instance.gpu_model}) has no peak in the "
                         f"planner; known: {', '.join(DENSE_BF16_TFLOPS)}")
    ranks = nodes * instance.gpus
    memory_ = gpu_memory(m, ranks, shape)  # first: it refuses a layout the trainer does not build
    tokens_per_gpu = shape.tokens_per_step / ranks
    achieved = ACHIEVED_FRACTION_OF_PEAK * DENSE_BF16_TFLOPS[instance.gpu_model] * 1e12
    compute = tokens_per_gpu * training_flops_per_token(m, shape.sequence, shape.checkpointing) / achieved
    # the expert all-to-alls span one EP group: consecutive ranks, a node's GPUs first
    ep = shape.expert_parallel or ranks
    per_node = min(instance.gpus, ep)
    nvlink, efa = expert_traffic_bytes_per_token(m, ep // per_node, per_node, backend, shape.checkpointing)
    ulysses = ulysses_bytes_per_token(m, shape.context_parallel, shape.checkpointing)
    if shape.context_parallel <= instance.gpus:  # a CP group within a node
        nvlink += ulysses
    else:
        efa += ulysses
    microbatches = math.ceil(tokens_per_gpu * shape.context_parallel / shape.microbatch_tokens)
    collective_gbps = efa_gbps("alltoall", nodes) if nodes > 1 else NVLINK_GBPS
    step = StepTime(compute, m.num_hidden_layers * tokens_per_gpu * nvlink / (NVLINK_GBPS * 1e9),
                    m.num_hidden_layers * tokens_per_gpu * efa / (efa_gbps(backend, nodes) * 1e9) if nodes > 1 else 0,
                    microbatches * fsdp_bytes_per_microbatch(m, ranks, shape) / (collective_gbps * 1e9))
    return Plan(m, instance, nodes, backend, shape, memory_, step)


def ulysses_bytes_per_token(m: ModelConfig, cp: int, checkpointing: Checkpointing) -> float:
    """Bytes a token's Ulysses all-to-alls move per GPU per layer: queries, keys and values to their heads' ranks
    and the output back, (cp - 1) / cp of each in bf16, in the forward, the backward and a recomputed forward."""
    if cp == 1:
        return 0.0
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    passes = 2 + (0 if checkpointing == "off" else 1)
    return passes * BF16 * (2 * q + 2 * kv) * (cp - 1) / cp


def fsdp_bytes_per_microbatch(m: ModelConfig, ranks: int, shape: TrainingShape) -> float:
    """Bytes FSDP2 moves per GPU for each micro-batch: every sharded weight all-gathered in the forward and again
    in the backward (layers reshard after their forward) in the gathered dtype, its gradient reduce-scattered in
    float32; a ring collective over R ranks moves (R - 1) / R of the whole. Dense weights over every rank, the
    experts' copies (EP over part of the ranks) over the copies."""
    if not shape.fsdp or ranks == 1:
        return 0.0
    p = sharded_parameters(m, ranks, shape)
    copies = ranks // (shape.expert_parallel or ranks)
    moved = ((p.root + m.num_hidden_layers * p.dense_layer) * (ranks - 1) / ranks
             + m.num_hidden_layers * p.expert_layer * (copies - 1) / copies)
    return moved * (2 * param_bytes(shape) + memory.FP32)


def smallest_fit(m: ModelConfig, instance: InstanceType, *, backend: Backend = "alltoall",
                 shape: TrainingShape = TrainingShape(), max_nodes: int = 256) -> Plan | None:
    """The plan on the fewest nodes whose GPUs hold it (EP must split the experts evenly), or None."""
    for nodes in range(1, max_nodes + 1):
        ranks = nodes * instance.gpus
        if m.num_experts % ranks or ranks % (shape.expert_parallel or ranks):
            continue  # the experts must split evenly over every rank (by EP, or EP and their copies)
        candidate = plan(m, instance, nodes, backend=backend, shape=shape)
        if candidate.fits:
            return candidate
    return None


def longest_sample(m: ModelConfig, instance: InstanceType, nodes: int, *, backend: Backend = "alltoall",
                   shape: TrainingShape = TrainingShape(), granule: int = 1024) -> Plan | None:
    """The plan of the longest single sample that trains on `nodes` nodes (to `granule` tokens): one micro-batch
    of it, its tokens split over shape.context_parallel ranks, attention over its whole length. Only the
    activations grow with it. None if not even `granule` tokens fit."""
    def at(tokens: int) -> Plan:
        return plan(m, instance, nodes, backend=backend,
                    shape=replace(shape, microbatch_tokens=tokens, sequence=tokens))

    if not at(granule).fits:
        return None
    lo, hi = 1, 2  # in granules: lo fits, hi is the first tried that may not
    while at(hi * granule).fits:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(mid * granule).fits else (lo, mid)
    return at(lo * granule)
