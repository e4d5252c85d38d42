"""The sparse MoE block: router -> dispatcher -> SwiGLU experts -> combine, plus optional shared experts.
Parameter names follow Hugging Face (Qwen3-MoE `mlp.gate.weight`, fused `mlp.experts.gate_up_proj` /
`down_proj` as transformers 5 holds them; DeepSeek-V3 `e_score_correction_bias` and `shared_experts`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl_eks.core.run import ModelConfig

from .compute import MoECompute, RoutingSpec
from .dispatch import Dispatcher, LocalDispatcher
from .router import expert_load, expert_scores, load_balancing_loss, node_limit_bias, weights_for


def routing_spec(config: ModelConfig) -> RoutingSpec:
    return RoutingSpec(top_k=config.num_experts_per_tok, scoring=config.router, n_group=config.n_group,
                       topk_group=config.topk_group, renormalize=config.norm_topk_prob,
                       scaling=config.routed_scaling_factor)


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.spec = routing_spec(config)
        self.node_groups, self.max_nodes = config.expert_node_groups, config.max_nodes_per_token
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        # The auxiliary-loss-free balancing bias (DeepSeek-V3): steers selection, never weights; updated by the
        # trainer from expert-load statistics, not by gradients.
        if config.router == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
                ) -> torch.Tensor:
        """`linear`: the products' kernel (the compute backend's: the exact mode's are row-invariant)."""
        return linear(F.silu(linear(x, self.gate_proj.weight)) * linear(x, self.up_proj.weight), self.down_proj.weight)


class Experts(nn.Module):
    """This rank's experts, fused: gate_up_proj [E_local, 2I, h] (gate rows first), down_proj [E_local, h, I].
    The block calls it as a module (not its weights directly) so that hooks on it run: FSDP2 gathers the experts'
    shards there when their copies are sharded (model/parallelize.py)."""

    def __init__(self, num_local: int, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden, width))

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor, compute: MoECompute) -> torch.Tensor:
        """Expert-sorted rows [N, h] with per-expert `counts` through each one's SwiGLU, in the rows' dtype."""
        w13, w2 = self.gate_up_proj, self.down_proj
        return compute.experts(x_sorted, counts, w13.to(x_sorted.dtype), w2.to(x_sorted.dtype))


@dataclass
class MoEOutput:
    out: torch.Tensor  # [T, h]
    ids: torch.Tensor  # [T, k] expert ids used
    aux_loss: torch.Tensor  # scalar, unscaled balance loss
    load: torch.Tensor  # [E] (token, slot) pairs per expert


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig, dispatcher: Dispatcher, compute: MoECompute):
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = Router(config)
        self.experts = Experts(dispatcher.num_local_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = (SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)
        self.dispatcher, self.compute = dispatcher, compute
        self.balance_loss = config.router_aux_loss_coef > 0

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None = None, *, statistics: bool = True,
                decode: bool = False, router_logits: torch.Tensor | None = None) -> MoEOutput:
        """statistics=False skips the expert load and the balance loss (zeros instead): decoding needs neither,
        and at one token per row their small kernels cost as much as the experts.
        decode=True (a rollout's decode step, no autograd): on one rank, the compute backend's `decode` op
        (triton: routing, experts and combine in two kernels, no permutation) does the layer when it can.
        router_logits: x's router product, already computed (a decode step fuses it with the norm before it)."""
        gate, spec = self.gate, self.gate.spec
        if torch.is_autocast_enabled(x.device.type):
            # Mixed precision (the GPU trainer's bf16 autocast): the experts compute in the autocast dtype, as
            # nn.Linear does, so tokens also travel in it (DeepEP moves bf16 only) and the float32 master
            # weights are cast on the way in (their gradients stay float32).
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if decode and replay_ids is None and gate.max_nodes is None and isinstance(self.dispatcher, LocalDispatcher):
            fast = self.compute.decode(x, gate.weight, spec, gate.e_score_correction_bias, self.experts.gate_up_proj,
                                       self.experts.down_proj, router_logits)
            if fast is not None:
                out, ids, logits = fast
                return self._finish(out, ids, x, logits, statistics)
        logits = F.linear(x, gate.weight) if router_logits is None else router_logits
        if replay_ids is not None:
            ids = replay_ids.to(torch.int64)
            weights = weights_for(expert_scores(logits, spec), ids, spec)
        else:
            bias = gate.e_score_correction_bias
            if gate.max_nodes is not None:
                bias = node_limit_bias(logits, spec, bias, gate.node_groups, gate.max_nodes)
            weights, ids = self.compute.route(logits, spec, bias)
        x_sorted, counts, handle = self.dispatcher.dispatch(x, weights, ids)
        y_sorted = self.experts(x_sorted, counts, self.compute)
        return self._finish(self.dispatcher.combine(y_sorted, handle), ids, x, logits, statistics)

    def _finish(self, out, ids, x, logits, statistics) -> MoEOutput:
        spec = self.gate.spec
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, self.compute.linear)
        if not statistics:  # zeros on the host: no kernel launch per layer of a decode step
            zero = torch.zeros((), dtype=torch.float32)
            return MoEOutput(out, ids, zero, zero.expand(self.num_experts))
        aux = (load_balancing_loss(expert_scores(logits, spec), ids, spec) if self.balance_loss
               else logits.new_zeros((), dtype=torch.float32))
        return MoEOutput(out, ids, aux, expert_load(ids.detach(), self.num_experts))
