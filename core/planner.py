"""The trainer-at-scale planner, torch-free: per-GPU memory of a training run on N nodes of an instance type, the
smallest node count that fits, and a predicted step time with the expert traffic over NVLink and EFA. `moerl plan`
prints it; `moerl manifests` refuses a run whose plan does not fit its trainer pool (core/run.py).

Memory comes from core/memory.py (the same model as the local GPU run's fit check); the activations of the
trainer's checkpointed layers are counted from what the model keeps (each layer's float32 input; with
"save_attention" also the attention output and its log-sum-exp), plus one layer's recomputed working set and one
chunk of the logprob head's logits. Step time is compute at an achieved fraction of the GPU's dense bf16 peak plus
the expert all-to-alls with no overlap (a bound from above), at the per-GPU bandwidths published for EFA
(../shared/REFERENCE.md; the comparison with published step times is in docs/benchmarks.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from . import memory
from .catalog import InstanceType

if TYPE_CHECKING:  # core/run.py checks a run against the plan, so the planner does not import it at run time
    from .run import ModelConfig

Checkpointing = Literal["off", "full", "save_attention"]
Backend = Literal["alltoall", "deepep"]

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


@dataclass(frozen=True)
class GpuMemory:
    parameters: int
    gradients: int
    optimizer: int
    reference: int
    activations: int
    overhead: int

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.reference + self.activations
                + self.overhead)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    nvlink_s: float
    efa_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.nvlink_s + self.efa_s


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


def kept_bytes_per_token(m: ModelConfig, checkpointing: Checkpointing) -> int:
    """What each layer keeps per token until the backward reaches it."""
    if checkpointing == "off":
        return layer_working_set_bytes_per_token(m)
    kept = 4 * m.hidden_size  # the layer's float32 input
    if checkpointing == "save_attention":
        kept += BF16 * m.num_attention_heads * m.head_dim + 4 * m.num_attention_heads
    return kept


def activation_bytes(m: ModelConfig, layers: int, tokens: int, checkpointing: Checkpointing) -> int:
    working = 0 if checkpointing == "off" else int(WORKING_SET_CALIBRATION * layer_working_set_bytes_per_token(m))
    return tokens * (layers * kept_bytes_per_token(m, checkpointing) + working) + LOGITS_CHUNK_BYTES


def gpu_memory(m: ModelConfig, ranks: int, shape: TrainingShape) -> GpuMemory:
    experts = m.routed_expert_parameter_count()
    dense = m.parameter_count() - experts
    state = memory.trainer_state(replicated=dense, experts=experts, ranks=ranks, fsdp=shape.fsdp)
    reference = memory.reference_bytes(replicated=dense, experts=experts, ranks=ranks,
                                       fsdp=shape.fsdp) if shape.reference else 0
    return GpuMemory(state.parameter_bytes, state.gradient_bytes, state.optimizer_bytes, reference,
                     activation_bytes(m, m.num_hidden_layers, shape.microbatch_tokens, shape.checkpointing),
                     memory.CUDA_OVERHEAD_BYTES)


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
    tokens_per_gpu = shape.tokens_per_step / ranks
    achieved = ACHIEVED_FRACTION_OF_PEAK * DENSE_BF16_TFLOPS[instance.gpu_model] * 1e12
    compute = tokens_per_gpu * training_flops_per_token(m, shape.sequence, shape.checkpointing) / achieved
    nvlink, efa = expert_traffic_bytes_per_token(m, nodes, instance.gpus, backend, shape.checkpointing)
    step = StepTime(compute, m.num_hidden_layers * tokens_per_gpu * nvlink / (NVLINK_GBPS * 1e9),
                    m.num_hidden_layers * tokens_per_gpu * efa / (efa_gbps(backend, nodes) * 1e9) if nodes > 1 else 0)
    return Plan(m, instance, nodes, backend, shape, gpu_memory(m, ranks, shape), step)


def smallest_fit(m: ModelConfig, instance: InstanceType, *, backend: Backend = "alltoall",
                 shape: TrainingShape = TrainingShape(), max_nodes: int = 256) -> Plan | None:
    """The plan on the fewest nodes whose GPUs hold it (EP must split the experts evenly), or None."""
    for nodes in range(1, max_nodes + 1):
        if m.num_experts % (nodes * instance.gpus):
            continue  # EP spans every rank: the experts must split evenly over them
        candidate = plan(m, instance, nodes, backend=backend, shape=shape)
        if candidate.fits:
            return candidate
    return None
