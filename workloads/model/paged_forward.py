"""The paged forward: tokens through the model's modules over a pool of keys and values kept in blocks and found
through block tables, with the norms, products, cache writes and attention through a compute backend's
`ForwardKernels`. The rollout engine's prefill and decode steps run it over their KV cache
(rollout/model_runner.py); the trainer's forward in the exact numerics mode runs it over a pool of its own packed
sequences (`sequence_hidden`), so the engine and the trainer compute a token's logits with one code path and, on
the `exact` backend, bitwise alike.

What it reads of a MoETransformer: `config`, `model.embed_tokens`, `model.norm`, `lm_head.weight`, and of each of
`model.layers` the `input_layernorm` and `post_attention_layernorm` modules, `self_attn` (`q_norm`, `k_norm`,
`o_proj.weight`, its head counts; its q/k/v projection weights only to load `PackedAttention`) and `mlp` (called
with decode=True; `mlp.gate.weight` for a norm fused with the router product).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..moe.layer import MoEOutput
from .forward_kernels import ForwardKernels
from .rotary import rotary
from .transformer import MoETransformer


class KVPool(Protocol):
    """Keys/values [L, blocks, block_size, H_kv, D], block tables [slots, max_blocks] int32 and the routed expert
    ids [blocks, block_size, L, k] of every fed position."""

    keys: torch.Tensor
    values: torch.Tensor
    tables: torch.Tensor
    routing: torch.Tensor

    def locate(self, slot: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each (slot, position), on the device."""


class PackedAttention:
    """The [q; k; v] projection weights and [q_norm; k_norm] weights of each layer, one buffer each, so that a
    forward projects with one product and normalises queries and keys with one kernel (as vLLM's packed linear
    layers load q, k and v into one tensor). Built from the model's parameters; `load` copies them in again, in
    place, so CUDA graphs that read the buffers stay valid: call it whenever the model's weights change (the engine's
    Replica.swap does after weight_staging.install, through Decoder.load_weights). The price is a second copy of the
    q/k/v weights (about 1 GB in bf16 at Qwen3-30B-A3B's 48 layers)."""

    @torch.no_grad()
    def __init__(self, model: MoETransformer) -> None:
        self.qkv, self.qk_norm = packed_weights(model)

    @classmethod
    def differentiable(cls, model: MoETransformer) -> PackedAttention:
        """The buffers made afresh with autograd from the model's parameters (the same values, so the same bits):
        the exact mode's trainer forward, whose gradient reaches the q/k/v and q/k-norm weights through them."""
        packed = cls.__new__(cls)
        packed.qkv, packed.qk_norm = packed_weights(model)
        return packed

    @torch.no_grad()
    def load(self, model: MoETransformer) -> None:
        for qkv, qk_norm, a in zip(self.qkv, self.qk_norm, attention_modules(model)):
            torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], out=qkv)
            torch.stack([a.q_norm.weight, a.k_norm.weight], out=qk_norm)


def attention_modules(model: MoETransformer) -> list:
    return [layer.self_attn for layer in model.model.layers]


def packed_weights(model: MoETransformer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's [q; k; v] projection weights and [q_norm; k_norm] weights, one tensor each."""
    attention = attention_modules(model)
    return ([torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) for a in attention],
            [torch.stack([a.q_norm.weight, a.k_norm.weight]) for a in attention])


def paged_forward(model: MoETransformer, packed: PackedAttention, kernels: ForwardKernels, pool: KVPool,
                  slot: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                  key_len: int, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Feed `tokens` [N] at `positions` [N] of slots `slot` [N], packed with no padding (prompts back to back, with
    their `tiles` from the kernels' prefill_tiles; or one token per row, tiles None): their keys, values and routed
    experts go into the pool through the block tables, and each token attends causally to its slot's positions up
    to its own. Returns the logits [R, V] after tokens `last` [R]. `key_len` (> every position) bounds the
    attention."""
    hidden, _ = paged_hidden(model, packed, kernels, pool, slot, tokens, positions, last, key_len, tiles)
    return kernels.linear(hidden, model.lm_head.weight)


def paged_hidden(model: MoETransformer, packed: PackedAttention, kernels: ForwardKernels, pool: KVPool,
                 slot: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                 key_len: int, tiles: torch.Tensor | None = None, training: bool = False,
                 run_layer: Callable | None = None) -> tuple[torch.Tensor, list[MoEOutput]]:
    """`paged_forward` up to the LM head: (the final normed hidden states [R, hidden] after tokens `last` [R],
    whose product with `lm_head.weight` (kernels.linear, row by row) is the logits; each MoE layer's output).
    `training` (the exact mode's differentiable trainer forward): the MoE layers compute their balance loss and
    expert load, and never take the decode kernels, which have no backward (the grouped path they would replace
    gives a token the same bits on the exact backend: kernels/backend.py's ExactCompute). `run_layer`: how each
    layer runs, run_layer(layer_forward, i, h, delta) -> (h, delta, MoEOutput) (default: called; the trainer's
    passes activation checkpointing's recomputation)."""
    c = model.config
    n = tokens.shape[0]
    block, offset = pool.locate(slot, positions)
    h = model.model.embed_tokens(tokens)
    cos, sin = (t[:, 0, 0] for t in rotary(positions[:, None], c.head_dim, c.rope_theta, h.dtype))
    seen = positions + 1  # what decode attention reads, once for all layers

    def layer_forward(i: int, h: torch.Tensor, delta: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, MoEOutput]:
        layer = model.model.layers[i]
        attn = layer.self_attn
        x, h = kernels.add_norm(layer.input_layernorm, h, delta)
        q, k, v = attention_inputs(kernels, packed, i, attn, x, cos, sin)  # [N, heads, D]
        out = kernels.attend(q, k, v, pool.keys[i], pool.values[i], block, offset, pool.tables, slot, positions,
                             key_len, tiles, seen)
        x, h, logits = kernels.add_norm_router(layer.post_attention_layernorm, layer.mlp.gate.weight, h,
                                               kernels.linear(out.reshape(n, attn.heads * attn.head_dim),
                                                              attn.o_proj.weight))
        moe = layer.mlp(x, statistics=training, decode=not training, router_logits=logits)
        return h, moe.out.view(n, c.hidden_size), moe

    layers, delta = [], None
    for i in range(len(model.model.layers)):
        h, delta, moe = layer_forward(i, h, delta) if run_layer is None else run_layer(layer_forward, i, h, delta)
        layers.append(moe)
    pool.routing[block, offset] = torch.stack([moe.ids for moe in layers], 1).view(
        n, len(layers), c.num_experts_per_tok).to(pool.routing.dtype)
    return kernels.add_norm(model.model.norm, h[last], delta[last])[0], layers


def attention_inputs(kernels: ForwardKernels, packed: PackedAttention, layer: int, attn, x: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., hidden] -> (rotary(q_norm(q)) [..., H, D], rotary(k_norm(k)) [..., H_kv, D], v [..., H_kv, D])
    with each token's cos, sin [..., D]: one product over the packed weights, one call for queries and keys."""
    heads, kv_heads, dim = attn.heads, attn.kv_heads, attn.head_dim
    qk, v = kernels.linear(x, packed.qkv[layer]).split([(heads + kv_heads) * dim, kv_heads * dim], -1)
    q, k = kernels.qk_norm_rope(attn.q_norm, attn.k_norm, packed.qk_norm[layer],
                                qk.unflatten(-1, (heads + kv_heads, dim)), heads, cos, sin)  # q and k side by side
    return q, k, v.unflatten(-1, (kv_heads, dim))


class SequencePool:
    """Packed sequences as a KV pool of blocks of one position: token t's keys and values at block t, and sequence
    s's table mapping its position p to block starts[s] + p (slot s is sequence s). The exact mode's trainer forward
    feeds its tokens through `paged_forward` into one, as the engine's prefill feeds its KV cache."""

    def __init__(self, config, sequence_lengths: list[int], device: torch.device, dtype: torch.dtype) -> None:
        lengths = torch.tensor(sequence_lengths, device=device, dtype=torch.long)  # long also when empty
        tokens = int(lengths.sum())
        self.starts = torch.cumsum(lengths, 0) - lengths
        shape = (config.num_hidden_layers, tokens, 1, config.num_key_value_heads, config.head_dim)
        self.keys = torch.empty(shape, device=device, dtype=dtype)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        # entries past a sequence's end are never read (no token sees past its own sequence)
        self.tables = (self.starts[:, None] + torch.arange(max(sequence_lengths, default=0), device=device)).clamp(
            max=tokens - 1).to(torch.int32)
        self.routing = torch.empty(tokens, 1, config.num_hidden_layers, config.num_experts_per_tok,
                                   dtype=torch.int64, device=device)

    def locate(self, slot: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.starts[slot] + positions, torch.zeros_like(positions)


def sequence_hidden(model: MoETransformer, packed: PackedAttention, kernels: ForwardKernels, tokens: torch.Tensor,
                    sequence_lengths: list[int], training: bool = False, run_layer: Callable | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, list[MoEOutput]]:
    """tokens [N] of sequences packed back to back (their lengths sum to N) -> (the final normed hidden states [N,
    hidden] after every token, routed expert ids [N, L, k], each MoE layer's output; `training` and `run_layer` as
    paged_hidden's): each token attends causally within its own sequence, its positions from 0, through the engine's
    paged forward. Their logits are kernels.linear(hidden, model.lm_head.weight), a row's bits the same in any chunk
    of rows on the `exact` backend (so a caller need never hold [N, vocabulary] at once). No sequences (N = 0) is a
    forward too: under expert parallelism a rank without tokens still joins every MoE layer's exchange with the
    ranks that have some."""
    lengths = [int(n) for n in sequence_lengths]
    if min(lengths, default=1) < 1 or sum(lengths) != tokens.shape[0]:
        raise ValueError(f"sequence_lengths {lengths} must be >= 1 each and sum to the {tokens.shape[0]} tokens")
    device = tokens.device
    pool = SequencePool(model.config, lengths, device, model.model.embed_tokens.weight.dtype)
    counts = torch.tensor(lengths, device=device, dtype=torch.long)
    slot = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    positions = torch.arange(tokens.shape[0], device=device) - pool.starts[slot]
    segments = [(int(s), n) for s, n in zip(pool.starts.tolist(), lengths)]
    hidden, layers = paged_hidden(model, packed, kernels, pool, slot, tokens, positions,
                                  torch.arange(tokens.shape[0], device=device), max(lengths, default=1),
                                  kernels.prefill_tiles(segments, device), training, run_layer)
    return hidden, pool.routing[:, 0], layers
