"""Run configuration (`configs/runs/<name>.yaml`): one typed file per RL run, read by k8s/ and workloads/ alike.

`resolve_run` checks a run against the environment it targets (pool sizes, GPU memory, EP backend limits) and
fixes the EP backend once, so manifests and trainer logs carry the same resolved choice.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from . import memory, planner
from .cluster import FSX_MOUNT_PATH
from .deploy import DeployConfig
from .ep_backends import EpBackend, EpBackendChoice, Topology, UnsupportedBackend, check_backend, resolve_backend
from .environment import EnvironmentConfig
from .hardware import TMA_ROW_BYTES
from .rl_config import RLConfig
from .schema import ConfigError, fail, parse


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-MoE-compatible decoder (field names follow Hugging Face's Qwen3MoeConfig) plus router options."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # Router: "softmax" = Qwen3 (softmax, top-k, optional renormalisation); "sigmoid" = DeepSeek-V3 (sigmoid
    # scores, selection-only bias, group-limited top-k, routed scaling factor).
    router: Literal["softmax", "sigmoid"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    max_nodes_per_token: int | None = None  # node-limited routing over contiguous expert ranges
    # How many contiguous expert ranges ("nodes") max_nodes_per_token counts; static, so rollout and trainer
    # choose alike. Set it to the trainer's EP node count so the limit keeps expert traffic inside nodes.
    expert_node_groups: int = 1
    n_shared_experts: int = 0
    router_aux_loss_coef: float = 0.0
    dtype: Literal["bfloat16", "float32"] = "bfloat16"

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                     "num_experts_per_tok", "n_group", "topk_group"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", self.num_key_value_heads,
                 f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.num_experts_per_tok > self.num_experts:
            fail("num_experts_per_tok", self.num_experts_per_tok, f"must be <= num_experts ({self.num_experts})")
        if self.num_experts % self.n_group:
            fail("n_group", self.n_group, f"must divide num_experts ({self.num_experts})")
        if self.topk_group > self.n_group:
            fail("topk_group", self.topk_group, f"must be <= n_group ({self.n_group})")
        if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
            fail("topk_group", self.topk_group, "the selected groups hold fewer experts than num_experts_per_tok")
        if self.router == "softmax" and self.n_group != 1:
            fail("n_group", self.n_group, "group-limited routing needs router: sigmoid")
        if self.max_nodes_per_token is not None and self.max_nodes_per_token < 1:
            fail("max_nodes_per_token", self.max_nodes_per_token, "must be >= 1 or omitted")
        if self.max_nodes_per_token is not None:
            if self.num_experts % self.expert_node_groups:
                fail("expert_node_groups", self.expert_node_groups, f"must divide num_experts ({self.num_experts})")
            if self.max_nodes_per_token > self.expert_node_groups:
                fail("max_nodes_per_token", self.max_nodes_per_token,
                     f"must be <= expert_node_groups ({self.expert_node_groups})")
            if self.max_nodes_per_token * (self.num_experts // self.expert_node_groups) < self.num_experts_per_tok:
                fail("max_nodes_per_token", self.max_nodes_per_token,
                     "the allowed nodes hold fewer experts than num_experts_per_tok")
        if self.n_shared_experts < 0:
            fail("n_shared_experts", self.n_shared_experts, "must be >= 0")

    def parameter_count(self) -> int:
        h, e, i = self.hidden_size, self.num_experts, self.moe_intermediate_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + 2 * self.head_dim
        experts = (e + self.n_shared_experts) * 3 * h * i + h * e
        per_layer = attn + experts + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h

    def routed_expert_parameter_count(self) -> int:
        """The parameters expert parallelism splits over ranks (the routed experts; shared experts replicate)."""
        return self.num_hidden_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def bytes_per_parameter(self) -> int:
        return 2 if self.dtype == "bfloat16" else 4

    @property
    def weights_gib(self) -> float:
        """The size of one copy of the weights in the model's dtype (a published version, a serving replica)."""
        return self.parameter_count() * self.bytes_per_parameter / 2**30


@dataclass(frozen=True)
class ParallelismConfig:
    ep_backend: EpBackendChoice = "auto"
    trainer_nodes: int = 1
    # Trainer ranks per node; default: every GPU of the trainer instance type (or 2 CPU processes locally).
    ranks_per_node: int | None = None

    def validate(self) -> None:
        if self.trainer_nodes < 1:
            fail("trainer_nodes", self.trainer_nodes, "must be >= 1")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            fail("ranks_per_node", self.ranks_per_node, "must be >= 1")


@dataclass(frozen=True)
class RolloutConfig:
    min_servers: int = 1
    max_servers: int = 1
    gpus_per_server: int = 1
    max_batch_size: int = 64
    max_new_tokens: int = 256
    # The slowest per-row decode rate (tokens per second each row of a full batch gets) a healthy server may have:
    # request deadlines allow for it (core/deadlines.py). The default is deliberately low (generous deadlines); a
    # run with long completions declares its pool's rate, or its deadline cap refuses it.
    min_row_tokens_per_s: float = 1.0
    # Liveness: a server whose engine loop has neither finished a step nor idled for this long answers /health
    # with 503 (Kubernetes then restarts it). Longer than the slowest step: a full batch's prefill.
    hung_after_s: float = 120.0
    # When a server takes a new weight version in: `inflight` between two decode steps, rows running go on with the
    # new weights and the KV cache they have (PipelineRL's in-flight updates; each token records its version), or
    # `drain`: once no row runs, every row of one version (strictly on-policy). Default: inflight, or drain when
    # rl.orchestrator.max_staleness is 0 (RunConfig.weight_swap).
    weight_swap: Literal["inflight", "drain"] | None = None
    # Queue each decode step on the GPU before the host books the previous one's tokens (vLLM's
    # --async-scheduling), so the host's per-step work runs while the GPU computes instead of between its steps.
    # Tokens are the same; a row that finished its prefill decodes one step later, a row that samples a stop token
    # costs one dropped step, and logprobs may differ in the last bits where rows join a step at another time.
    # A server of one GPU only (the ranks of a sharded one agree on every forward). Default: on for a server of
    # one GPU (as vLLM's default where it is supported): on the H200 the colocated loop's GPU was busy 0.896 of
    # the time without it and 0.94 with it (workloads/BENCHMARKS-rl.md); off for a sharded one.
    async_scheduling: bool | None = None

    def validate(self) -> None:
        if self.async_scheduling and self.gpus_per_server > 1:
            fail("async_scheduling", self.async_scheduling, f"must be false with gpus_per_server "
                 f"{self.gpus_per_server}: a sharded server's ranks agree on every forward, one step at a time")
        if not 1 <= self.min_servers <= self.max_servers:
            fail("min_servers", self.min_servers, f"must be between 1 and max_servers ({self.max_servers})")
        if not self.hung_after_s > 0:
            fail("hung_after_s", self.hung_after_s, "must be > 0 seconds")
        for name in ("gpus_per_server", "max_batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        if not self.min_row_tokens_per_s > 0:
            fail("min_row_tokens_per_s", self.min_row_tokens_per_s, "must be > 0 tokens per second")

    @property
    def look_ahead(self) -> bool:
        """async_scheduling as the servers apply it (its default resolved against gpus_per_server)."""
        return self.gpus_per_server == 1 if self.async_scheduling is None else self.async_scheduling

    @property
    def autoscaled(self) -> bool:
        """The server count moves between min and max with the rollout backlog (KEDA on a cluster)."""
        return self.max_servers > self.min_servers


@dataclass(frozen=True)
class RoleGpus:
    """The GPUs of this machine one role of a local run uses, and the share of each GPU's memory it may take
    (vLLM's gpu_memory_utilization): the process caps its allocator at it, and the rollout engine sizes its KV
    cache from what the share leaves after the weights."""

    gpus: tuple[int, ...] = (0,)
    memory_share: float = 0.45

    def validate(self) -> None:
        if not self.gpus or any(g < 0 for g in self.gpus):
            fail("gpus", list(self.gpus), "must list one or more GPU indices >= 0")
        if len(set(self.gpus)) != len(self.gpus):
            fail("gpus", list(self.gpus), "must not name a GPU twice (one trainer rank or rollout rank per GPU)")
        if not 0 < self.memory_share <= 1:
            fail("memory_share", self.memory_share, "must be in (0, 1]: a fraction of each GPU's memory")


@dataclass(frozen=True)
class LocalGpus:
    """`local_gpus:` a local run on this machine's GPUs (absent: on its CPUs). The trainer runs one rank per GPU
    of `trainer.gpus` over NCCL; rollout server i takes `rollout.gpus_per_server` GPUs of `rollout.gpus` in
    order. Roles may share a GPU, each within its memory share."""

    trainer: RoleGpus = field(default_factory=RoleGpus)
    rollout: RoleGpus = field(default_factory=RoleGpus)

    def shares_by_gpu(self) -> dict[int, float]:
        shares: dict[int, float] = {}
        for role in (self.trainer, self.rollout):
            for gpu in role.gpus:
                shares[gpu] = shares.get(gpu, 0.0) + role.memory_share
        return shares

    def validate(self) -> None:
        for gpu, total in sorted(self.shares_by_gpu().items()):
            if total > 1 + 1e-9:
                fail("rollout.memory_share", self.rollout.memory_share,
                     f"trainer.memory_share ({self.trainer.memory_share}) + rollout.memory_share "
                     f"({self.rollout.memory_share}) = {total:.2f} of GPU {gpu}: the shares of the roles on a GPU "
                     "must add up to at most 1")


# A run with triton compute is refused unless its expert rows fit TMA in bfloat16 (a float32 model runs under
# autocast, so bfloat16 is what the experts compute in on GPUs).
TRITON_ROW_MULTIPLE = TMA_ROW_BYTES // 2


@dataclass(frozen=True)
class ResolvedPlacement:
    """Where `moerl manifests` resolved a cluster run: the run file it ships to pods carries this instead of the
    environment (whose account, admin role and network stay out of the cluster), so every pod resolves the same EP
    backend without reading cdk.json."""

    environment: str
    trainer_instance_type: str
    rollout_instance_type: str
    topology: Topology
    ep_backend: EpBackend
    ep_backend_reason: str


@dataclass(frozen=True)
class RunConfig:
    name: str
    model: ModelConfig
    environment: str | None = None  # the cdk.json environment it runs in; None = this machine, no cluster
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    deploy: DeployConfig | None = None  # images and pod settings; required when the run has an environment
    # The MoE layer's hot path (routing, permutation, grouped SwiGLU GEMMs): `torch` (torch._grouped_mm) runs
    # anywhere; `triton` (moe_rl_eks.kernels) needs CUDA GPUs.
    moe_compute: Literal["torch", "triton"] = "torch"
    # `exact`: every product, norm, attention and log-softmax whose result for a row could depend on the batch runs
    # batch-invariant kernels (moe_rl_eks.kernels.invariant_*, the `exact` compute backend), the same ones in the
    # engine's prefill and decode and in the trainer's logprob forward, so rollout logprobs equal the trainer's
    # bitwise; `standard`: the fast kernels of moe_compute. Configurations where the two sides cannot run the same
    # kernels are refused (exact_refusal).
    numerics: Literal["standard", "exact"] = "standard"
    # Written by `moerl manifests` into the run file pods read (never by hand): the run already resolved against
    # its environment, which the file then omits (environment: null).
    resolved: ResolvedPlacement | None = None
    local_gpus: LocalGpus | None = None  # a local run on this machine's GPUs; None: on its CPUs

    def validate(self) -> None:
        if self.resolved is not None and self.environment is not None:
            fail("resolved", self.resolved.environment, "a resolved run file names no environment (moerl manifests "
                 "writes it); resolve the original run file instead")
        # Invariants between roles: what the orchestrator asks of rollout servers must be what they accept.
        s = self.rl.sampling
        if s.max_tokens > self.rollout.max_new_tokens:
            fail("rl.sampling.max_tokens", s.max_tokens,
                 f"must be <= rollout.max_new_tokens ({self.rollout.max_new_tokens}), which servers enforce")
        o = self.rl.orchestrator
        slowest = s.max_tokens / self.rollout.min_row_tokens_per_s
        if slowest > o.request_timeout_s:
            fail("rl.orchestrator.request_timeout_s", o.request_timeout_s,
                 f"must be >= {slowest:.0f} s: a {s.max_tokens}-token request (rl.sampling.max_tokens) at the slowest "
                 f"rate a healthy server may decode a row, {self.rollout.min_row_tokens_per_s:g} tokens/s "
                 "(rollout.min_row_tokens_per_s), would never finish within it")
        if self.rl.algorithm.group_size > s.max_n:
            fail("rl.algorithm.group_size", self.rl.algorithm.group_size,
                 f"must be <= rl.sampling.max_n ({s.max_n}): each group is one request with n = group_size")
        e = self.rl.evaluation
        # Periodic evaluation samples through the rollout servers (the final one in-process, without their caps).
        if e.every_steps and e.max_tokens is not None and e.max_tokens > self.rollout.max_new_tokens:
            fail("rl.evaluation.max_tokens", e.max_tokens,
                 f"must be <= rollout.max_new_tokens ({self.rollout.max_new_tokens}), which servers enforce")
        if e.every_steps and e.samples_per_prompt > s.max_n:
            fail("rl.evaluation.samples_per_prompt", e.samples_per_prompt,
                 f"must be <= rl.sampling.max_n ({s.max_n}): the servers sample each evaluation prompt as one "
                 "request with n = samples_per_prompt")
        if self.moe_compute == "triton" or self.numerics == "exact":
            setting = "moe_compute: triton" if self.moe_compute == "triton" else "numerics: exact"
            for name in ("hidden_size", "moe_intermediate_size"):
                size = getattr(self.model, name)
                if size % TRITON_ROW_MULTIPLE:
                    fail(f"model.{name}", size, f"must be a multiple of {TRITON_ROW_MULTIPLE} with {setting} "
                         f"(its kernels read expert rows through TMA, which needs {TMA_ROW_BYTES}-byte rows)")
        if self.numerics == "exact":
            refusal = exact_refusal(self)
            if refusal is not None:
                fail("numerics", "exact", refusal)
        if self.local_gpus is not None:
            self._validate_local_gpus(self.local_gpus)
        if self.rollout.weight_swap == "inflight" and o.max_staleness == 0:
            fail("rollout.weight_swap", "inflight",
                 "needs rl.orchestrator.max_staleness >= 1 (it is 0): a row running across a swap has tokens of two "
                 "versions, and a synchronous run trains only the newest; use drain, or allow staleness 1")
        if self.model.num_experts % self.rollout.gpus_per_server:
            fail("rollout.gpus_per_server", self.rollout.gpus_per_server,
                 f"must divide model.num_experts ({self.model.num_experts}): a server splits the experts evenly "
                 "over its GPUs")


    def _validate_local_gpus(self, local: LocalGpus) -> None:
        if self.environment is not None or self.resolved is not None:
            fail("local_gpus", self.environment or "resolved", "places a local run's roles on this machine's GPUs; "
                 "a run with an environment (or resolved for a cluster) has none")
        ranks = self.parallelism.ranks_per_node
        if ranks is not None and ranks != len(local.trainer.gpus):
            fail("parallelism.ranks_per_node", ranks, f"must equal the {len(local.trainer.gpus)} GPUs of "
                 "local_gpus.trainer.gpus (one trainer rank per GPU: NCCL puts no two ranks on one GPU), or be omitted")
        servers = self.rollout.min_servers
        if self.rollout.max_servers != servers:
            fail("rollout.max_servers", self.rollout.max_servers,
                 f"must equal rollout.min_servers ({servers}) on local GPUs: nothing autoscales them")
        wanted = servers * self.rollout.gpus_per_server
        if len(local.rollout.gpus) != wanted:
            fail("local_gpus.rollout.gpus", list(local.rollout.gpus),
                 f"must list {wanted} GPUs: rollout.min_servers ({servers}) x rollout.gpus_per_server "
                 f"({self.rollout.gpus_per_server})")

    @property
    def weight_swap(self) -> Literal["inflight", "drain"]:
        """rollout.weight_swap as the servers apply it (its default resolved against rl.orchestrator.max_staleness)."""
        if self.rollout.weight_swap is not None:
            return self.rollout.weight_swap
        return "drain" if self.rl.orchestrator.max_staleness == 0 else "inflight"

    @property
    def serving_compute(self) -> str:
        """The compute backend (workloads/model/backends.py) of the rollout engine and of the trainer's logprob
        forward: `exact` in the exact numerics mode, else moe_compute. (The trainer's backward, and its forwards
        after a batch's first optimizer step, run moe_compute in both modes.)"""
        return "exact" if self.numerics == "exact" else self.moe_compute

    @property
    def weights_over_device(self) -> bool:
        """Versions go from the trainer's GPU memory straight to the rollout server's (workloads/rl/device_weights):
        a local GPU run whose trainer is one rank on the one GPU its one rollout server also uses, unless
        rl.weights.device_transfer is off. Expert-parallel trainers and servers go through the store."""
        local = self.local_gpus
        return (local is not None and self.rl.weights.device_transfer and len(local.trainer.gpus) == 1
                and self.rollout.gpus_per_server == 1 and local.rollout.gpus == local.trainer.gpus)

    def server_gpus(self, index: int) -> tuple[int, ...]:
        """The GPUs of rollout server `index` in a local GPU run."""
        per = self.rollout.gpus_per_server
        return self.local_gpus.rollout.gpus[index * per:(index + 1) * per]


def exact_refusal(run: RunConfig) -> str | None:
    """Why the exact numerics mode cannot make `run`'s rollout logprobs equal its trainer's bitwise, or None. Each
    case is one where the engine and the trainer would not run the same kernel, or not in the same order."""
    if run.rl.training.context_parallel > 1:
        # CP splits a query's keys over ranks and merges their partial softmaxes: another reduction order than the
        # exact attention's one pass over the keys in fixed tiles from position 0 (the engine's)
        return (f"refuses rl.training.context_parallel {run.rl.training.context_parallel}: context parallelism "
                "splits a query's keys over ranks and merges the parts, a reduction order the engine's attention "
                "does not take; use context_parallel: 1")
    if run.parallelism.ep_backend == "deepep":
        # the all-to-all's combine is one rank's unpermute on the token's own rank (moe/dispatch.py); DeepEP's
        # kernels reduce a token's expert outputs across ranks in an order of their own
        return ("refuses parallelism.ep_backend: deepep: DeepEP's combine adds a token's expert outputs in an order "
                "of its own, not in the slot order of every other path (one rank's combine, or the all-to-all's on "
                "the token's own rank); use alltoall (auto takes it in exact mode)")
    return None


@dataclass(frozen=True)
class ResolvedRun:
    """A run checked against where it runs; the single answer to 'which EP backend, how many ranks'."""

    run: RunConfig
    environment: EnvironmentConfig | None
    topology: Topology
    ep_backend: EpBackend
    ep_backend_reason: str


LOCAL_RANKS = 2  # the CPU run: two gloo processes


def load_run(path: str | Path) -> RunConfig:
    import yaml  # light, but only needed when reading files

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "", None, f"not valid YAML: {exc}") from None
    return parse(RunConfig, data, source=str(path))


def resolve_run(run: RunConfig, env: EnvironmentConfig | None, *, source: str = "run") -> ResolvedRun:
    """Check `run` against `env` (None for a local run) and resolve its EP backend."""
    src = f"{source} {run.name!r}"
    if run.resolved is not None:
        return _resolved_on_the_cluster(run, env, src)
    if (run.environment is None) != (env is None):
        raise ConfigError(src, "environment", run.environment,
                          "a run with an environment needs that environment's config; a local run takes none")
    if env is None:
        if run.parallelism.trainer_nodes != 1:
            raise ConfigError(src, "parallelism.trainer_nodes", run.parallelism.trainer_nodes, "a local run has one node")
        if run.local_gpus is not None:
            topo = Topology(nodes=1, ranks_per_node=len(run.local_gpus.trainer.gpus), device="cuda",
                            num_experts=run.model.num_experts, dtype=run.model.dtype)
        else:
            topo = Topology(nodes=1, ranks_per_node=run.parallelism.ranks_per_node or LOCAL_RANKS, device="cpu",
                            num_experts=run.model.num_experts)
            if run.moe_compute == "triton":
                raise ConfigError(src, "moe_compute", run.moe_compute,
                                  "the triton kernels need CUDA GPUs: a local run on the CPU uses torch (local_gpus "
                                  "places a local run on GPUs)")
            if run.numerics == "exact" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ConfigError(src, "numerics", run.numerics,
                                  "the exact kernels need CUDA GPUs (local_gpus places a local run on them), or on "
                                  "the CPU Triton's interpreter (TRITON_INTERPRET=1: tests, tiny models)")
    else:
        _check_fits(run, env, src)
        trainer = env.trainer_pool.spec
        ranks = run.parallelism.ranks_per_node or trainer.gpus
        topo = Topology(nodes=run.parallelism.trainer_nodes, ranks_per_node=ranks, device="cuda",
                        num_experts=run.model.num_experts, nvlink_domain=trainer.nvlink_domain, dtype=run.model.dtype,
                        deepep_internode=run.deploy is not None and run.deploy.images.deepep_efa)
    samples, ranks_total = run.rl.training.prompts_per_step * run.rl.algorithm.group_size, topo.ep_size
    cp = run.rl.training.context_parallel
    # a local run's trainer ranks are its torchrun's (the trainer checks them); a cluster run's are known here
    if run.model.num_attention_heads % cp or (env is not None and ranks_total % cp):
        raise ConfigError(src, "rl.training.context_parallel", cp,
                          f"must divide the model's {run.model.num_attention_heads} query heads"
                          + (f" and the {ranks_total} trainer ranks" if env is not None else ""))
    if samples < ranks_total * run.rl.algorithm.mini_batches:
        raise ConfigError(src, "rl.training.prompts_per_step", run.rl.training.prompts_per_step,
                          f"prompts_per_step x rl.algorithm.group_size ({run.rl.algorithm.group_size}) = {samples} "
                          f"samples per step "
                          f"must be >= {ranks_total} trainer ranks x rl.algorithm.mini_batches "
                          f"({run.rl.algorithm.mini_batches}): every rank trains on every mini-batch")
    ep = run.rl.training.expert_parallel
    if ep is not None and env is not None and ranks_total % ep:
        raise ConfigError(src, "rl.training.expert_parallel", ep, f"must divide the {ranks_total} trainer ranks")
    try:
        backend, why = resolve_backend(run.parallelism.ep_backend, expert_topology(topo, ep),
                                       exact=run.numerics == "exact")
    except UnsupportedBackend as exc:
        raise ConfigError(src, "parallelism.ep_backend", run.parallelism.ep_backend, str(exc)) from None
    if env is not None:
        _check_trainer_plan(run, env, src)
        _check_cluster_run(run, env, src)
    return ResolvedRun(run, env, topo, backend, why)


def expert_topology(trainer: Topology, expert_parallel: int | None) -> Topology:
    """The topology one EP group spans (what the EP backend is chosen for): the trainer's, or with EP over part of
    its ranks (rl.training.expert_parallel) that many consecutive ranks, a node's GPUs first."""
    if expert_parallel is None or expert_parallel == trainer.ep_size:
        return trainer
    per_node = min(trainer.ranks_per_node, expert_parallel)
    return replace(trainer, nodes=expert_parallel // per_node, ranks_per_node=per_node)


def _resolved_on_the_cluster(run: RunConfig, env: EnvironmentConfig | None, src: str) -> ResolvedRun:
    placement = run.resolved
    if env is not None:
        raise ConfigError(src, "resolved", placement.environment, "this run file was resolved by moerl manifests "
                          "already; it takes no environment")
    try:  # the image's code may know limits the manifests' did not: say so before any rank starts
        check_backend(placement.ep_backend, expert_topology(placement.topology, run.rl.training.expert_parallel))
    except UnsupportedBackend as exc:
        raise ConfigError(src, "resolved.ep_backend", placement.ep_backend, str(exc)) from None
    nodes = placement.topology.nodes
    weights = run.rl.weights
    store_path = weights.path or f"{run.rl.training.output_dir.rstrip('/')}/weights"
    if nodes > 1 and weights.kind != "s3" and not store_path.startswith(f"{FSX_MOUNT_PATH}/"):
        # Every trainer rank writes its experts into the store and rank 0 commits the version once all parts are
        # there: a node-local directory never sees the other nodes' parts, so no version would ever be committed.
        field_name, value = ("rl.weights.path", weights.path) if weights.path else ("rl.weights.kind", weights.kind)
        raise ConfigError(src, field_name, value,
                          f"a trainer on {nodes} nodes writes each node's experts into the weight store, which "
                          f"must be shared by the nodes: kind: s3, or kind: fs (or local) with a path under "
                          f"{FSX_MOUNT_PATH}/ (the FSx volume); {store_path!r} is node-local")
    return ResolvedRun(run, None, placement.topology, placement.ep_backend, placement.ep_backend_reason)


def resolved_run_file(resolved: ResolvedRun, run: RunConfig | None = None) -> RunConfig:
    """The run file `moerl manifests` ships to a cluster run's pods: ``run`` (default: the resolved run) with the
    placement it was resolved to instead of its environment."""
    env = resolved.environment
    if env is None:
        raise ValueError("resolved_run_file: a cluster run resolved against its environment is needed")
    placement = ResolvedPlacement(
        environment=env.name, trainer_instance_type=env.trainer_pool.instance_type,
        rollout_instance_type=env.rollout_pool.instance_type, topology=resolved.topology,
        ep_backend=resolved.ep_backend, ep_backend_reason=resolved.ep_backend_reason)
    return replace(run or resolved.run, environment=None, resolved=placement)


def _check_fits(run: RunConfig, env: EnvironmentConfig, src: str) -> None:
    trainer, rollout = env.trainer_pool, env.rollout_pool
    p, r = run.parallelism, run.rollout
    if p.trainer_nodes > trainer.max_size:
        raise ConfigError(src, "parallelism.trainer_nodes", p.trainer_nodes,
                          f"environment {env.name!r} trainer pool has at most {trainer.max_size} nodes")
    if p.ranks_per_node is not None and p.ranks_per_node > trainer.spec.gpus:
        raise ConfigError(src, "parallelism.ranks_per_node", p.ranks_per_node,
                          f"{trainer.instance_type} has {trainer.spec.gpus} GPUs")
    rspec = rollout.spec
    if r.gpus_per_server > rspec.gpus:
        raise ConfigError(src, "rollout.gpus_per_server", r.gpus_per_server, f"{rollout.instance_type} has {rspec.gpus} GPUs")
    servers_per_node = rspec.gpus // r.gpus_per_server
    if r.max_servers > servers_per_node * rollout.max_size:
        raise ConfigError(src, "rollout.max_servers", r.max_servers,
                          f"environment {env.name!r} rollout pool fits at most {servers_per_node * rollout.max_size} "
                          f"servers of {r.gpus_per_server} GPU(s) ({rollout.max_size} x {rollout.instance_type})")
    weights_gib = run.model.weights_gib
    # Weights may use at most 80 % of the server's GPU memory: the rest is KV cache and activations.
    usable = 0.8 * r.gpus_per_server * rspec.gpu_memory_gib
    if weights_gib > usable:
        raise ConfigError(src, "rollout.gpus_per_server", r.gpus_per_server,
                          f"{weights_gib:.0f} GiB of weights need more than 80 % of {r.gpus_per_server} x "
                          f"{rspec.gpu_memory_gib:.0f} GiB ({rspec.gpu_model}); raise gpus_per_server")


def _check_trainer_plan(run: RunConfig, env: EnvironmentConfig, src: str) -> None:
    """The trainer's per-GPU memory as the planner counts it (`moerl plan`) must fit the trainer pool's GPUs."""
    t, p = run.rl.training, run.parallelism
    spec = env.trainer_pool.spec
    ranks = p.trainer_nodes * (p.ranks_per_node or spec.gpus)
    shape = planner.TrainingShape(microbatch_tokens=t.max_tokens_per_microbatch,
                                  checkpointing=t.activation_checkpointing, fsdp=t.fsdp,
                                  reference=run.rl.algorithm.kl_coef > 0, expert_parallel=t.expert_parallel,
                                  param_dtype=t.fsdp_param_dtype, context_parallel=t.context_parallel)
    need = planner.gpu_memory(run.model, ranks, shape).total
    have = planner.USABLE_FRACTION * spec.gpu_memory_mib * 2**20
    if need > have:
        raise ConfigError(src, "parallelism.trainer_nodes", p.trainer_nodes,
                          f"each of the {ranks} trainer GPUs ({env.trainer_pool.instance_type}) would need "
                          f"{need / 2**30:.1f} GiB (parameters, gradients, AdamW state"
                          f"{', the KL reference' if shape.reference else ''} and activations of "
                          f"{t.max_tokens_per_microbatch}-token micro-batches; `moerl plan`) of the "
                          f"{have / 2**30:.1f} GiB usable; add nodes, turn on rl.training.fsdp or shrink "
                          "rl.training.max_tokens_per_microbatch")


def _check_cluster_run(run: RunConfig, env: EnvironmentConfig, src: str) -> None:
    """What a run needs to start on a cluster at all: images, shared storage, the autoscaler's metric source."""
    if run.deploy is None:
        raise ConfigError(src, "deploy", None, "a run with an environment needs deploy.images (trainer and rollout "
                          "image tags or digests in the stack's ECR repositories)")
    if run.rollout.autoscaled and not env.observability.prometheus:
        raise ConfigError(src, "rollout.max_servers", run.rollout.max_servers,
                          f"autoscaling (max_servers > min_servers = {run.rollout.min_servers}) reads the queue depth "
                          f"from Amazon Managed Prometheus, which environment {env.name!r} turns off "
                          "(observability.prometheus); set max_servers = min_servers")
    # Pods come and go (restarts, autoscaling): what must outlive one lives on FSx or S3, never on a pod's disk.
    shared = f"{FSX_MOUNT_PATH}/"
    output_dir = run.rl.training.output_dir
    if not output_dir.startswith(shared):
        raise ConfigError(src, "rl.training.output_dir", output_dir,
                          f"checkpoints of a cluster run must be on the FSx volume (under {shared}) so a restarted "
                          "trainer resumes from them")
    if not env.storage.fsx:
        raise ConfigError(src, "environment", run.environment,
                          f"environment {env.name!r} has no FSx volume (storage.fsx) for the run's checkpoints")
    weights = run.rl.weights
    if weights.kind == "local" or (weights.kind == "fs" and not str(weights.path).startswith(shared)):
        raise ConfigError(src, "rl.weights", weights.kind if weights.kind == "local" else weights.path,
                          f"rollout servers on other nodes load the weights: use kind: fs with a path under {shared} "
                          "or kind: s3")
    routing = run.rl.routing
    if run.rl.algorithm.routing_replay and not routing.directory(output_dir).startswith(shared):
        raise ConfigError(src, "rl.routing.path", routing.path,
                          f"rollout servers write each choice's routed experts where every trainer rank reads them: "
                          f"a path under {shared} (default: <output_dir>/routing)")


def check_local_gpus(run: RunConfig, gpu_count: int, *, source: str = "run") -> None:
    """Refuse a local GPU run naming a GPU index this machine lacks (`gpu_count`: torch.cuda.device_count(), passed
    in so that core stays free of torch), before any role starts: a role would otherwise die at its first CUDA call,
    with CUDA's 'invalid device ordinal' in its log and nothing naming the run file's field."""
    for role in ("trainer", "rollout"):
        gpus = getattr(run.local_gpus, role).gpus
        missing = [g for g in gpus if g >= gpu_count]
        if missing:
            have = f"(0..{gpu_count - 1})" if gpu_count else "(no CUDA device visible)"
            raise ConfigError(f"{source} {run.name!r}", f"local_gpus.{role}.gpus", list(gpus),
                              f"GPU {missing[0]} is not on this machine, which has {gpu_count} {have}")


def check_local_machine(run: RunConfig, gpu_memory_bytes: list[int], *, source: str = "run") -> None:
    """Refuse a local GPU run this machine cannot hold, before any role starts: GPUs it lacks (`gpu_memory_bytes`
    lists the memory of each of its GPUs), or a role whose weights, optimizer state and smallest KV cache do not
    fit its memory share (core/memory.py)."""
    local, src = run.local_gpus, f"{source} {run.name!r}"
    check_local_gpus(run, len(gpu_memory_bytes), source=source)
    m = run.model
    experts = m.routed_expert_parameter_count()
    replicated = m.parameter_count() - experts
    trainer = memory.trainer_memory(replicated=replicated, experts=experts, ranks=len(local.trainer.gpus),
                                    reference=run.rl.algorithm.kl_coef > 0, fsdp=run.rl.training.fsdp)
    rollout = memory.rollout_memory(replicated=replicated, experts=experts, gpus=run.rollout.gpus_per_server,
                                    dtype_bytes=m.bytes_per_parameter, layers=m.num_hidden_layers,
                                    kv_heads=m.num_key_value_heads, head_dim=m.head_dim)
    row = run.rl.sampling.max_prompt_tokens + run.rollout.max_new_tokens  # the longest row a server admits
    # Versions over device memory: the trainer keeps one export of the served weights on its GPU.
    export = m.parameter_count() * m.bytes_per_parameter if run.weights_over_device else 0
    # A full micro-batch's activations as the planner counts them (seen on an H200: without them a trainer planned
    # to fit 0.70 of the GPU with 2 GiB spare ran out of memory at its second step, once AdamW's state existed).
    training = run.rl.training
    activations = planner.activation_bytes(m, m.num_hidden_layers, training.max_tokens_per_microbatch,
                                           training.activation_checkpointing)
    needs = {"trainer": (trainer.fixed_bytes + export + activations, "float32 weights, gradients and AdamW state"
                         + (" and the KL reference" if run.rl.algorithm.kl_coef > 0 else "")
                         + (" and the weights' export to the rollout server" if export else "")
                         + f", and {training.max_tokens_per_microbatch}-token micro-batches' activations"),
             "rollout": (rollout.fixed_bytes + row * rollout.per_token_bytes,
                         f"the weights and the KV cache of one {row}-token row")}
    for role, (need, what) in needs.items():
        share = getattr(local, role).memory_share
        for gpu in getattr(local, role).gpus:
            have = share * gpu_memory_bytes[gpu]
            if need > have:
                raise ConfigError(src, f"local_gpus.{role}.memory_share", share,
                                  f"{share} of GPU {gpu}'s {gpu_memory_bytes[gpu] / 2**30:.1f} GiB is "
                                  f"{have / 2**30:.1f} GiB; the {role} needs {need / 2**30:.1f} GiB there ({what})")
