"""A decoder-only MoE transformer with Qwen3-MoE's layout and parameter names (so Hugging Face checkpoints load
and save; see checkpoint.py), DeepSeek-V3-style router options, expert parallelism, and routing replay for training
on the experts the rollout used. Its forward is the trainer's (whole sequences, or sequences packed in one row);
the rollout engine runs the same modules over its paged KV cache (workloads/rollout/model_runner.py). Plain
PyTorch: activation checkpointing, FSDP and the trainer's expert split are applied from outside (parallelize.py),
and so are the collectives that gather its state."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch import nn

from moe_rl_eks.core.run import ModelConfig
from moe_rl_eks.core.schema import parse

from ..moe.dispatch import LocalDispatcher
from ..moe.layer import MoEBlock
from ..moe.parallel import ExpertParallel, local_experts
from ..moe.router import balance_bias_step
from .backends import get_compute
from .rotary import apply_rotary, rotary


# Attention backends for packed sequences (one SDPA call per sequence, packed_attention): torch's flash kernel first.
# cuDNN's fused attention runs a long causal sequence's forward + backward ~1.9x faster on an H200 (552 against 297
# TFLOP/s at 8,192 tokens; torchtitan prefers it too), but its first call at a new shape builds a plan (90-115 ms),
# and packed sequences each have a length of their own. It goes first from CUDNN_MIN_TOKENS, where one pass through
# 48 layers saves more than a new plan costs (3.2 ms a layer at 8,192 tokens with Qwen3-30B-A3B's heads; 0.9 ms at
# 4,096 does not pay); `moerl bench-train-attention`, workloads/results/h200-bench-train-attention.json.
PACKED_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
LONG_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *PACKED_SDPA_BACKENDS]
CUDNN_MIN_TOKENS = 8192


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, S, V]; None when the forward was asked for hidden states only
    hidden: torch.Tensor  # [B, S, h] the final normed hidden states (what the lm_head and a value head read)
    routing: list[torch.Tensor] | None  # per MoE layer: expert ids [B, S, k] (int64), when return_routing
    aux_loss: torch.Tensor  # router_aux_loss_coef x mean per-layer balance loss (0 when the coefficient is 0)
    expert_load: torch.Tensor  # [L, E] (token, slot) pairs per expert per layer, this rank's real tokens; detached


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, fused: Callable | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # The compute backend's fused training norm (forward and backward one kernel each, same numerics; the
        # `triton` backend's `norm`), used under autocast only: it returns the autocast dtype, which is what the
        # next matmul or attention would have cast the float32 result to.
        self.fused = fused

    def mixed_precision(self, x: torch.Tensor) -> bool:
        return self.fused is not None and torch.is_autocast_enabled(x.device.type)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """rope: (cos, sin) [tokens, D] for x [..., heads, D], applied after the norm (fused path only)."""
        if self.mixed_precision(x):
            return self.fused(x, self.weight, self.eps, torch.get_autocast_dtype(x.device.type), rope)
        if rope is not None:
            raise ValueError("RMSNorm applies the rotary embedding only through a fused kernel under autocast")
        # As Hugging Face: normalise in float32, cast back, then scale.
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, fused_norm: Callable | None = None):
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, fused_norm)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, fused_norm)
        # Packed attention, replaced from outside by context parallelism (context_parallel.py) with the same
        # signature: (q [1, H, S, D], k, v [1, H_kv, S, D], segments, gqa) -> [1, S, H, D].
        self.attend: Callable | None = None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> q [..., H, D], k and v [..., H_kv, D], before the norms and the rotary embedding."""
        lead = x.shape[:-1]
        return (self.q_proj(x).view(*lead, self.heads, self.head_dim),
                self.k_proj(x).view(*lead, self.kv_heads, self.head_dim),
                self.v_proj(x).view(*lead, self.kv_heads, self.head_dim))

    def forward(self, x, cos, sin, mask, segments: list[int] | None = None):
        """segments: packed sequences (B = 1, no mask): each attends causally within itself only."""
        b, s, _ = x.shape
        q, k, v = self.project(x)
        v = v.transpose(1, 2)
        if self.q_norm.mixed_precision(q):  # norm and rotary embedding in one kernel per direction
            table = (cos[:, 0].reshape(b * s, self.head_dim), sin[:, 0].reshape(b * s, self.head_dim))
            q, k = self.q_norm(q, rope=table).transpose(1, 2), self.k_norm(k, rope=table).transpose(1, 2)
        else:
            q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)
            k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)
        gqa = self.heads != self.kv_heads
        if b == 0 or s == 0:  # an EP rank may hold no tokens; CUDA's SDPA returns None for an empty batch
            out = q.new_zeros(q.shape).transpose(1, 2)
        elif segments is not None:
            out = (self.attend or packed_attention)(q, k, v, segments, gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa).transpose(1, 2)
        return self.o_proj(out.reshape(b, s, self.heads * self.head_dim))


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int], gqa: bool
                     ) -> torch.Tensor:
    """Variable-length attention as one causal SDPA per sequence (flash/memory-efficient kernels on GPUs): no
    [S, S] mask over the packed row, and no token attends across a sequence boundary. q [1, H, S, D], k and v
    [1, H_kv, S, D] -> [1, S, H, D]: each output is concatenated as [1, S_i, H, D], so the packed row is built in
    the o_proj's layout (no copy after). A sequence of CUDNN_MIN_TOKENS or more runs cuDNN's kernel where it
    takes the shape, any other the flash kernel."""
    parts = zip(q.split(segments, 2), k.split(segments, 2), v.split(segments, 2))
    # one backend context for the row (entering one costs ~16 us of host time, and a row packs dozens of sequences
    # in every layer); a long sequence sets its own inside it
    with sdpa_kernel(PACKED_SDPA_BACKENDS):
        return torch.cat([sequence_attention(qs, ks, vs, gqa).transpose(1, 2) for qs, ks, vs in parts], 1)


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
    """Causal SDPA over one packed sequence, q [1, H, n, D], k and v [1, H_kv, n, D] -> [1, H, n, D]: on the
    backends set around it, or with cuDNN's first from CUDNN_MIN_TOKENS (PACKED_SDPA_BACKENDS)."""
    if q.shape[2] < CUDNN_MIN_TOKENS:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    with sdpa_kernel(LONG_SDPA_BACKENDS, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, mlp: MoEBlock, fused_norm: Callable | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_norm)
        self.self_attn = Attention(config, fused_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_norm)
        self.mlp = mlp

    def forward(self, h, cos, sin, mask, replay, segments):
        """h [B, S, h] -> (h, expert ids [B*S, k], balance loss, expert load [E])."""
        b, s, hidden = h.shape
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, segments)
        moe = self.mlp(self.post_attention_layernorm(h).reshape(b * s, hidden), replay)
        return h + moe.out.view(b, s, hidden), moe.ids, moe.aux_loss, moe.load


class Backbone(nn.Module):
    """Hugging Face's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # plain: a value head reads its float32 output


class MoETransformer(nn.Module):
    def __init__(self, config: ModelConfig, *, ep: ExpertParallel | None = None, compute: str = "torch"):
        super().__init__()
        parse(ModelConfig, asdict(config), source="model config")  # ConfigError naming the field
        self.config, self.ep = config, ep
        self.cp = None  # context parallelism (context_parallel.ContextParallel), set by parallelize
        self.compute, self.compute_name = get_compute(compute), compute
        layers = []
        for _ in range(config.num_hidden_layers):
            dispatcher = (ep.dispatcher(self.compute, config.num_experts, config.hidden_size) if ep is not None
                          else LocalDispatcher(self.compute, config.num_experts))
            layers.append(DecoderLayer(config, MoEBlock(config, dispatcher, self.compute),
                                       self.compute.norm))
        self.model = Backbone(config, layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Hugging Face's init: normal(0, std) matrices, ones for norms, zero router bias. Seed before calling
        (under EP, seed every rank alike so replicated weights agree; experts then differ by rank slice)."""
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std)
        for name, buf in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()

    def forward(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                routing_replay: list[torch.Tensor] | None = None, return_routing: bool = False,
                sequence_lengths: list[int] | None = None, logits: bool = True) -> ModelOutput:
        """input_ids [B, S], each row attending causally to itself. positions [B, S] default: 0..S-1.
        routing_replay: per MoE layer the expert ids [B, S, k] to use instead of routing (rollout routing replay).
        sequence_lengths: packed sequences (training): B = 1 and the row is these sequences back to back; each
        attends causally within itself and its positions start at 0 (no padding). Under context parallelism
        input_ids (and routing_replay) are this rank's slice of that row, sequence_lengths the whole row's.
        logits=False skips the lm_head (the trainer scores tokens from `hidden` in chunks, model/logprobs.py)."""
        b, s = input_ids.shape
        c = self.config
        split = self.cp.size if self.cp is not None and sequence_lengths is not None else 1
        if sequence_lengths is not None:
            sequence_lengths = [int(n) for n in sequence_lengths]
            if b != 1 or sum(sequence_lengths) != s * split:
                raise ValueError(f"sequence_lengths {sequence_lengths} (sum {sum(sequence_lengths)}) need one packed "
                                 f"row of that many tokens (got [{b}, {s}]" + (f" x {split} CP ranks)" if split > 1
                                                                             else ")"))
        if routing_replay is not None and len(routing_replay) != c.num_hidden_layers:
            raise ValueError(f"routing_replay has {len(routing_replay)} layers; the model has {c.num_hidden_layers}")
        device = input_ids.device
        if positions is None and sequence_lengths is not None:
            lengths = torch.tensor(sequence_lengths, device=device, dtype=torch.long)
            total = s * split
            starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths, output_size=total)
            positions = (torch.arange(total, device=device) - starts).unsqueeze(0)
            if split > 1:
                lo, hi = self.cp.slice_bounds(total)
                positions = positions[:, lo:hi]
        elif positions is None:
            positions = torch.arange(s, device=device).expand(b, s)
        mask = None
        if sequence_lengths is None:
            slots = torch.arange(s, device=device)
            mask = (slots <= slots[:, None]).expand(b, 1, s, s)  # causal

        h = self.model.embed_tokens(input_ids)
        cos, sin = rotary(positions, c.head_dim, c.rope_theta, h.dtype)
        routing, aux, loads = [], [], []
        for i, layer in enumerate(self.model.layers):
            replay = routing_replay[i].reshape(b * s, c.num_experts_per_tok) if routing_replay is not None else None
            h, ids, layer_aux, load = layer(h, cos, sin, mask, replay, sequence_lengths)
            routing.append(ids.view(b, s, c.num_experts_per_tok))
            aux.append(layer_aux)
            loads.append(load)
        hidden = self.model.norm(h)
        return ModelOutput(self.lm_head(hidden) if logits else None, hidden, routing if return_routing else None,
                           aux_loss(c, aux), torch.stack(loads))

    @torch.no_grad()
    def update_routing_bias(self, expert_load: torch.Tensor, rate: float = 1e-3) -> None:
        """One auxiliary-loss-free balancing step (sigmoid router) from a step's ModelOutput.expert_load [L, E],
        summed over EP ranks first (identical biases on every rank keep routing identical)."""
        if self.config.router != "sigmoid":
            raise ValueError(f"routing bias updates need router: sigmoid, not {self.config.router!r}")
        for layer, load in zip(self.model.layers, expert_load):
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(balance_bias_step(bias, load, rate))

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full (unsharded) state dict; under EP each rank keeps its own contiguous expert slice."""
        self.load_state_dict(expert_slice(state, local_experts(self.ep, self.config.num_experts)), strict=True)


def aux_loss(config: ModelConfig, balance_losses: list[torch.Tensor]) -> torch.Tensor:
    """The forward's auxiliary loss from its MoE layers' balance losses: their mean times router_aux_loss_coef."""
    return config.router_aux_loss_coef * torch.stack(balance_losses).mean()


def weights_dtype(config: ModelConfig) -> torch.dtype:
    """The dtype a model's weights are published and served in (its config's `dtype`)."""
    return getattr(torch, config.dtype)


def expert_slice(state: dict[str, torch.Tensor], experts: range | None) -> dict[str, torch.Tensor]:
    """A full state with the fused expert tensors cut to `experts` (one EP rank's slice; None keeps all)."""
    if experts is None:
        return dict(state)
    return {name: t[experts.start:experts.stop] if ".mlp.experts." in name else t for name, t in state.items()}
