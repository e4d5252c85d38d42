"""Continuous-batching decoding over a paged KV cache, and the sampler.

A `Decoder` runs up to `slots` rows at once, each up to `max_len` positions. Their keys, values and routed expert
ids live in one pool of fixed-size blocks (`PagedCache`); a row finds its positions through its block table. Rows
join at any step: a row waits until a slot and its prompt's blocks are free, its prompt is prefilled (packed with
the other prompts being prefilled, no padding, in chunks of at most `prefill_tokens` tokens interleaved with the
running rows' decode steps), and it then decodes one token per step, taking a new block as it crosses a block
boundary, until it samples a stop token or reaches its max_tokens; finished and cancelled rows return their slot
and blocks at once. When the decoding rows need more blocks than are free, the newest are preempted and
recomputed later. A group's rows (GRPO's n samples of one prompt, admitted together) share one prefill and the
prompt's full blocks; only its partial last block is copied.

Every row computes only on its own positions, and its randomness is a counter-based function of (seed, row, step)
computed on the device (Philox4x32-10), so a row's tokens, logprobs and routing do not depend on which rows
shared its steps (up to floating-point reduction order).
"""
from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..model import MoETransformer
from ..model.transformer import _rotate, rotary
from ..moe.parallel import decode_phase
from .engine_api import RowOutput, RowRequest, SamplingParams

log = logging.getLogger(__name__)

# ---- counter-based randomness ----------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor], rounds: int = 10
               ) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 (Salmon et al., Random123) on int64 tensors (or numpy uint64 arrays) holding 32-bit words. The
    32 x 32-bit products wrap modulo 2**64, which keeps both of their 32-bit halves exact."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        p0, p1 = c0 * _PHILOX_M[0], c2 * _PHILOX_M[1]
        c0, c1, c2, c3 = ((p1 >> 32) & _MASK32) ^ c1 ^ k0, p1 & _MASK32, ((p0 >> 32) & _MASK32) ^ c3 ^ k1, p0 & _MASK32
    return c0, c1, c2, c3


def row_uniform(key_lo: torch.Tensor, key_hi: torch.Tensor, row: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row from (seed, row, step): the seed's two 32-bit words are the key. On a CPU the
    same function runs on numpy's uint64 arrays (one vectorised op per word instead of a tensor op's overhead); on
    a GPU in one Triton kernel (kernels/philox.py; tested bitwise against this path)."""
    if key_lo.is_cuda:
        from moe_rl_eks.kernels.philox import row_uniform as philox_kernel

        return philox_kernel(key_lo, key_hi, row, step)
    import numpy as np

    lo, hi, r, t = (x.numpy().astype(np.uint64) for x in (key_lo, key_hi, row, step))
    word = philox4x32((t & _MASK32, r & _MASK32, t >> 32, np.zeros_like(r)), (lo, hi))[0]
    return torch.from_numpy((word >> 8).astype(np.float32) * np.float32(1.0 / (1 << 24)))


# ---- sampling ------------------------------------------------------------------------------------------------
@dataclass
class Sampled:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_ids: torch.Tensor | None  # [B, K] int64
    top_logprobs: torch.Tensor | None  # [B, K] float32


@dataclass
class SamplingRows:
    """Per-row sampling parameters as device tensors [B], plus host flags that let the sampler skip work no row
    asked for."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor  # int64, 0 = off
    min_p: torch.Tensor
    raw: torch.Tensor  # bool: logprob_mode == "raw"
    key_lo: torch.Tensor  # int64 words of the seed
    key_hi: torch.Tensor
    row: torch.Tensor  # int64
    step: torch.Tensor  # int64: index of the token being sampled in the completion
    filtered: bool  # some row has top-k, top-p < 1 or min-p > 0
    any_raw: bool
    top_n: int  # the largest top_logprobs asked for


def sample(logits: torch.Tensor, rows: SamplingRows) -> Sampled:
    """logits [B, V] -> a token per row and its logprob, with no host synchronisation. A row samples from
    softmax(logits / temperature) cut by top-k, then top-p (of what top-k kept), then min-p, renormalised
    (inverse CDF of its own counter-based uniform); temperature 0 takes the argmax. Its logprob is under that
    processed distribution (temperature 0 counting as 1), or under softmax(logits) for logprob_mode "raw"."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = rows.temperature == 0
    scaled = logits / torch.where(greedy, 1.0, rows.temperature)[:, None]
    logp = torch.log_softmax(scaled, -1)
    if rows.filtered:
        sorted_logp, order = logp.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=logits.device)
        keep = rank[None, :] < torch.where(rows.top_k > 0, rows.top_k, vocab)[:, None]
        p = sorted_logp.exp() * keep
        p = p / p.sum(-1, keepdim=True)
        keep &= (p.cumsum(-1) - p < rows.top_p[:, None]) | (rows.top_p[:, None] >= 1)
        keep &= sorted_logp >= sorted_logp[:, :1] + torch.log(rows.min_p)[:, None]  # p >= min_p * p_max
        kept = torch.zeros_like(keep).scatter(-1, order, keep)  # back to vocabulary order
        logp = torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), -1)
    cdf = logp.exp().cumsum(-1)
    u = row_uniform(rows.key_lo, rows.key_hi, rows.row, rows.step)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)[:, 0]
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    reported = logp
    if rows.any_raw:
        reported = torch.where(rows.raw[:, None], torch.log_softmax(logits, -1), logp)
    logprobs = reported.gather(-1, tokens[:, None])[:, 0]
    top_ids = top_lps = None
    if rows.top_n:
        top_lps, top_ids = reported.topk(rows.top_n, -1)
    return Sampled(tokens, logprobs, top_ids, top_lps)


# ---- the paged cache and its forward ---------------------------------------------------------------------
@dataclass
class PagedCache:
    """Keys/values [L, blocks + 1, block_size, H_kv, D] and the routed expert ids [blocks + 1, block_size, L, k] of
    every fed position, in one pool of fixed-size blocks shared by all rows. Row slot s finds its position p at
    block tables[s, p // block_size], offset p % block_size; `tables` [slots + 1, max_blocks] lives on the device
    (a static tensor: CUDA graphs replay against it) with its host copy in `owned`. The extra last block is
    scratch: padding tokens of a forward write there, and every table entry not granted to a row points at it
    (the extra last slot, the padding rows', is all scratch). Blocks carry reference counts: a group's rows share
    their prompt's full blocks."""

    keys: torch.Tensor
    values: torch.Tensor
    routing: torch.Tensor
    tables: torch.Tensor
    owned: list[list[int]]  # per slot, the blocks granted to it (host copy of the live part of its table row)
    refs: list[int]  # per block, how many slots hold it
    free: list[int]  # blocks no slot holds
    max_len: int  # positions a row may hold
    pending: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, index, block) not yet on the device

    @classmethod
    def allocate(cls, config, slots: int, max_len: int, blocks: int, block_size: int, device, dtype
                 ) -> "PagedCache":
        if block_size < 1 or blocks < 1:
            raise ValueError(f"kv cache: block_size {block_size} and blocks {blocks} must be >= 1")
        shape = (config.num_hidden_layers, blocks + 1, block_size, config.num_key_value_heads, config.head_dim)
        ids = torch.uint8 if config.num_experts <= 256 else torch.int16
        max_blocks = -(-max_len // block_size)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(blocks + 1, block_size, config.num_hidden_layers, config.num_experts_per_tok,
                               dtype=ids, device=device),
                   torch.full((slots + 1, max_blocks), blocks, dtype=torch.int32, device=device),
                   [[] for _ in range(slots + 1)], [0] * blocks, list(range(blocks - 1, -1, -1)), max_len)

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    @property
    def blocks(self) -> int:
        return self.keys.shape[1] - 1

    @property
    def scratch(self) -> int:
        """The scratch slot (padding rows)."""
        return self.tables.shape[0] - 1

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def grow(self, slot: int, positions: int) -> bool:
        """Grant `slot` fresh blocks until it holds `positions` positions; False (nothing granted) if too few are
        free."""
        need = self.blocks_for(positions) - len(self.owned[slot])
        if need > len(self.free):
            return False
        for _ in range(need):
            self._grant(slot, self.free.pop())
        return True

    def share(self, source: int, target: int, count: int) -> None:
        """`target` (holding no blocks) starts with `source`'s first `count` blocks, shared."""
        for block in self.owned[source][:count]:
            self._grant(target, block)

    def copy_block(self, source: int, target: int, index: int) -> None:
        """Block `index` of slot `target` becomes a copy of the same block of `source` (a shared prompt's partial
        last block: each row then writes its own continuation there)."""
        src, dst = self.owned[source][index], self.owned[target][index]
        self.keys[:, dst] = self.keys[:, src]
        self.values[:, dst] = self.values[:, src]
        self.routing[dst] = self.routing[src]

    def release(self, slot: int) -> None:
        """Drop `slot`'s blocks (freed when no other slot holds them); its table row points at scratch again."""
        for index, block in enumerate(self.owned[slot]):
            self.refs[block] -= 1
            if not self.refs[block]:
                self.free.append(block)
            self.pending.append((slot, index, self.blocks))
        self.owned[slot] = []

    def _grant(self, slot: int, block: int) -> None:
        self.refs[block] += 1
        self.pending.append((slot, len(self.owned[slot]), block))
        self.owned[slot].append(block)

    def sync_tables(self) -> None:
        """Write the table entries changed since the last call to the device (one copy; before any forward)."""
        if self.pending:
            latest = {(slot, index): block for slot, index, block in self.pending}  # a freed entry granted again
            update = torch.tensor([(*k, v) for k, v in latest.items()], dtype=torch.int32).t()
            if self.tables.is_cuda:
                update = update.pin_memory().to(self.tables.device, non_blocking=True)
            self.tables[update[0].long(), update[1].long()] = update[2]
            self.pending = []

    def locate(self, slot: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each (slot, position), on the device."""
        page = self.block_size
        return self.tables[slot, positions // page].long(), positions % page

    def routing_of(self, slot: int, length: int) -> torch.Tensor:
        """The expert ids of `slot`'s first `length` positions [length, L, k] (a copy)."""
        blocks = torch.tensor(self.owned[slot][:self.blocks_for(length)], device=self.routing.device)
        return self.routing[blocks].flatten(0, 1)[:length].clone()

    def stats(self) -> dict[str, int]:
        return {"blocks_total": self.blocks, "blocks_free": len(self.free),
                "blocks_used": self.blocks - len(self.free), "block_size": self.block_size}


def attend(q: torch.Tensor, cache: PagedCache, layer: int, slot: torch.Tensor, positions: torch.Tensor,
           key_len: int, fused: bool, tiles: torch.Tensor | None, seen: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D] of tokens at `positions` [N] of slots `slot` [N] -> [N, H, D], causal over each slot's cache.
    `fused`: the Triton kernels read through the block tables, only the positions each token sees (a prefill's
    packed prompts by their `tiles`, a decode step one token per row: static shapes, CUDA graphs replay it);
    otherwise the first `key_len` positions of each token's slot are gathered for PyTorch's attention. `seen`:
    positions + 1, when the caller computed it once for all layers (one kernel fewer per layer of a decode step)."""
    keys, values = cache.keys[layer], cache.values[layer]
    if fused:
        if tiles is not None:
            from moe_rl_eks.kernels.prefill_attention import prefill_attention

            return prefill_attention(q, keys, values, cache.tables, slot, positions, tiles)
        from moe_rl_eks.kernels.decode_attention import decode_attention

        return decode_attention(q, keys, values, cache.tables, slot, positions + 1 if seen is None else seen)
    n = q.shape[0]
    blocks = cache.tables[slot, :cache.blocks_for(key_len)].long()  # [N, blocks]
    k = keys[blocks].flatten(1, 2)[:, :key_len].transpose(1, 2)  # [N, H_kv, key_len, D]
    v = values[blocks].flatten(1, 2)[:, :key_len].transpose(1, 2)
    mask = torch.arange(key_len, device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None],
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.view(n, q.shape[1], q.shape[2])


def _add_norm(module, h: torch.Tensor, delta: torch.Tensor | None, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h + delta), h + delta) with the model's RMSNorm `module` (no add when delta is None); `fused` does
    both in one kernel of the same arithmetic."""
    if fused:
        from moe_rl_eks.kernels.rmsnorm import rms_norm

        return (rms_norm(h, module.weight, module.eps), h) if delta is None else \
            rms_norm(delta, module.weight, module.eps, residual=h)
    h = h if delta is None else h + delta
    return module(h), h


def _add_norm_router(layer, h: torch.Tensor, delta: torch.Tensor, fused: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(post-attention norm(h + delta), h + delta, the router's logits or None): on a GPU, at the few tokens of a
    decode step, one kernel for all three (kernels/rmsnorm.py); else the norm alone (the MoE block routes)."""
    norm, router = layer.post_attention_layernorm, layer.mlp.gate.weight
    if fused and h.numel() // h.shape[-1] <= _FUSED_ROUTER_TOKENS and router.dtype == h.dtype:
        from moe_rl_eks.kernels.rmsnorm import add_rms_norm_project

        return add_rms_norm_project(delta, h, norm.weight, norm.eps, router)
    return (*_add_norm(norm, h, delta, fused), None)


# Up to this many tokens the router product is fused into the norm before it (its few rows per program spread
# over the GPU); more tokens amortise one GEMM. (The MoE decode kernels have their own cut-over, DECODE_MAX_TOKENS.)
_FUSED_ROUTER_TOKENS = 16


def _norm_rope(module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
    """x [..., heads, D] -> rotary(norm(x)) [..., heads, D] with each token's cos, sin [..., D] (the q/k path of the
    model's attention)."""
    if fused:
        from moe_rl_eks.kernels.rmsnorm import rms_norm

        return rms_norm(x, module.weight, module.eps, rope=(cos, sin))
    return _rotate(module(x), cos.unsqueeze(-2), sin.unsqueeze(-2))


def share_qkv_weights(model: MoETransformer) -> None:
    """Make each layer's q, k and v projection weights views of one [q; k; v] buffer (`qkv_weight` on the attention
    module), and its q_norm and k_norm weights views of one [2, D] buffer (`qk_norm_weight`), so that a decode step
    projects with one GEMM and normalises queries and keys with one kernel. Weight loads copy into the parameters
    (load_state_dict, weight_staging.install), so they write through the views and the buffers stay current."""
    for layer in model.model.layers:
        attn = layer.self_attn
        for name, weights in (("qkv_weight", [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                              ("qk_norm_weight", [attn.q_norm.weight, attn.k_norm.weight])):
            if _shared(attn, name, weights) is not None:
                continue
            if weights[0].dim() == 1:
                buffer = torch.stack([w.detach() for w in weights])
                views = buffer.unbind(0)
            else:
                buffer = torch.cat([w.detach() for w in weights])
                views = buffer.split([w.shape[0] for w in weights])
            for w, view in zip(weights, views):
                w.data = view
            setattr(attn, name, buffer)


def _shared(attn, name: str, weights: list[torch.Tensor]) -> torch.Tensor | None:
    """attn's buffer `name` if `weights` are still its consecutive views (a move to another device or dtype, or an
    assignment of new tensors, makes copies: then None)."""
    buffer = getattr(attn, name, None)
    if buffer is None:
        return None
    at = buffer.data_ptr()
    for w in weights:
        if w.device != buffer.device or w.dtype != buffer.dtype or w.data_ptr() != at:
            return None
        at += w.numel() * w.element_size()
    return buffer


def _linear(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    """x @ weight.T; `fused`: at a few rows through the Triton product where it beats cuBLAS (kernels/gemv.py)."""
    if fused:
        from moe_rl_eks.kernels.gemv import decode_linear

        return decode_linear(x, weight)
    return F.linear(x, weight)


def _attention_inputs(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., hidden] -> (rotary(q_norm(q)) [..., H, D], rotary(k_norm(k)) [..., H_kv, D], v [..., H_kv, D]) with
    each token's cos, sin [..., D]. With shared buffers (share_qkv_weights): one product, and on a GPU one norm +
    rotary kernel for queries and keys together."""
    lead, heads, kv_heads, dim = x.shape[:-1], attn.heads, attn.kv_heads, attn.head_dim
    qkv = _shared(attn, "qkv_weight", [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    if qkv is None:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    else:
        q, k, v = _linear(x, qkv, fused).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        norms = _shared(attn, "qk_norm_weight", [attn.q_norm.weight, attn.k_norm.weight])
        if fused and norms is not None and attn.q_norm.eps == attn.k_norm.eps:
            from moe_rl_eks.kernels.rmsnorm import rms_norm

            qk = q.as_strided((*lead, heads + kv_heads, dim), (*q.stride()[:-1], dim, 1))
            qk = rms_norm(qk, norms, attn.q_norm.eps, rope=(cos, sin), second_weight_from=heads)
            return qk[..., :heads, :], qk[..., heads:, :], v.view(*lead, kv_heads, dim)
    return (_norm_rope(attn.q_norm, q.view(*lead, heads, dim), cos, sin, fused),
            _norm_rope(attn.k_norm, k.view(*lead, kv_heads, dim), cos, sin, fused), v.view(*lead, kv_heads, dim))


def forward_tokens(model: MoETransformer, cache: PagedCache, slot: torch.Tensor, tokens: torch.Tensor,
                   positions: torch.Tensor, last: torch.Tensor, key_len: int, fused: bool | None = None,
                   tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Feed `tokens` [N] at `positions` [N] of slots `slot` [N], packed with no padding (a prefill chunk's
    prompts back to back, with their `tiles` from `prefill_tiles`; or a decode step's one token per row, tiles
    None): their keys, values and routed experts go into the cache through the block tables, and each token
    attends causally to its slot's positions up to its own. Returns the logits [R, V] after tokens `last` [R].
    The layers are the model's own modules, so the numerics are the trainer's; `fused` (default: on a GPU)
    computes the norms (with the residual adds and the rotary embedding around them) and attention with this
    project's Triton kernels instead of PyTorch ops. `key_len` (> every position) bounds the unfused attention."""
    fused = tokens.is_cuda if fused is None else fused
    c = model.config
    n = tokens.shape[0]
    block, offset = cache.locate(slot, positions)
    h = model.model.embed_tokens(tokens)
    cos, sin = (t[:, 0, 0] for t in rotary(positions[:, None], c.head_dim, c.rope_theta, h.dtype))
    seen = positions + 1 if fused and tiles is None else None  # what decode attention reads, once for all layers
    routed, delta = [], None
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        x, h = _add_norm(layer.input_layernorm, h, delta, fused)
        q, k, v = _attention_inputs(attn, x, cos, sin, fused)  # [N, heads, D]
        if fused:
            from moe_rl_eks.kernels.kv_write import write_kv

            write_kv(cache.keys[i], cache.values[i], k, v, block, offset)
        else:
            cache.keys[i][block, offset] = k
            cache.values[i][block, offset] = v
        out = attend(q, cache, i, slot, positions, key_len, fused, tiles, seen)
        x, h, logits = _add_norm_router(layer, h, _linear(out.reshape(n, attn.heads * attn.head_dim),
                                                          attn.o_proj.weight, fused), fused)
        moe = layer.mlp(x, statistics=False, decode=True, router_logits=logits)
        delta = moe.out.view(n, c.hidden_size)
        routed.append(moe.ids)
    cache.routing[block, offset] = torch.stack(routed, 1).view(n, len(routed), -1).to(cache.routing.dtype)
    return _linear(_add_norm(model.model.norm, h[last], delta[last], fused)[0], model.lm_head.weight, fused)


# ---- rows and the decoder ----------------------------------------------------------------------------------
@dataclass(eq=False)
class Sequence:
    """One row in the decoder: its request, where it lives, what it produced."""

    request: RowRequest
    seed: int  # the resolved seed (fresh entropy when the request had none)
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    slot: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    routing: torch.Tensor | None = None  # [positions, layers, k] on the device, kept when the row finishes
    admitted: int = 0  # admission order (the newest decoding row is preempted first)
    preempted: int = 0  # times its blocks were taken back and it was queued to be recomputed
    prompt_logprobs: list[float | None] | None = None  # with params.prompt_logprobs, once its prefill ended
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def context(self) -> tuple[int, ...]:
        """What a prefill feeds: the prompt, and after a preemption the tokens sampled so far (the last of them
        not fed yet: prefilling it samples the next token, as the decode step would have)."""
        return self.request.prompt_ids + tuple(self.tokens)


@dataclass(eq=False)
class SharedPrefill:
    """Rows admitted together with one context (a prompt): the leader's slot is prefilled; the others share its
    full blocks and copy its partial last one."""

    rows: list[Sequence]
    prefilled: int = 0  # context tokens in the leader's cache so far
    # when a row asked for them: the logprobs of prompt tokens 1.. (and their alternatives), chunk by chunk
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def context(self) -> tuple[int, ...]:
        return self.rows[0].context


@dataclass
class StepEvents:
    """What one step produced: per row that sampled, (row, token, logprob, top alternatives); rows that
    finished (finish_reason set, slot freed)."""

    sampled: list[tuple[Sequence, int, float, list[tuple[int, float]] | None]]
    finished: list[Sequence]


@dataclass
class SlotState:
    """Per-slot device state [slots + 1]: what a decode step reads (length, last sampled token) and each row's
    sampling parameters and seed words, written once when the row is admitted. Decode steps gather from it by
    slot, so a step sends the host nothing but the slot list."""

    length: torch.Tensor
    last_token: torch.Tensor
    step: torch.Tensor  # tokens sampled so far (the counter of the next draw)
    row: torch.Tensor
    key_lo: torch.Tensor
    key_hi: torch.Tensor
    top_k: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    raw: torch.Tensor

    @classmethod
    def allocate(cls, slots: int, device) -> "SlotState":
        def zeros(dtype):
            return torch.zeros(slots + 1, dtype=dtype, device=device)
        return cls(*(zeros(torch.long) for _ in range(7)), *(zeros(torch.float32) for _ in range(3)),
                   zeros(torch.bool))

    def admit(self, seqs: list[Sequence]) -> None:
        idx = torch.tensor([s.slot for s in seqs], device=self.length.device)
        columns = {"length": [0] * len(seqs), "step": [len(s.tokens) for s in seqs],
                   "row": [s.request.row for s in seqs],
                   "key_lo": [s.seed & 0xFFFFFFFF for s in seqs], "key_hi": [s.seed >> 32 for s in seqs],
                   "top_k": [s.params.top_k for s in seqs], "temperature": [s.params.temperature for s in seqs],
                   "top_p": [s.params.top_p for s in seqs], "min_p": [s.params.min_p for s in seqs],
                   "raw": [s.params.logprob_mode == "raw" for s in seqs]}
        for name, values in columns.items():
            target = getattr(self, name)
            target[idx] = torch.tensor(values, dtype=target.dtype).to(target.device, non_blocking=True)

    def sampling(self, slot: torch.Tensor, flags: "SamplerFlags") -> SamplingRows:
        return SamplingRows(self.temperature[slot], self.top_p[slot], self.top_k[slot], self.min_p[slot],
                            self.raw[slot], self.key_lo[slot], self.key_hi[slot], self.row[slot], self.step[slot],
                            filtered=flags.filtered, any_raw=flags.any_raw, top_n=flags.top_n)


@dataclass(frozen=True)
class SamplerFlags:
    """What the rows of a step ask of the sampler beyond plain sampling (it skips the work no row asked for)."""

    filtered: bool  # some row has top-k, top-p < 1 or min-p > 0
    any_raw: bool
    top_n: int  # the largest top_logprobs asked for

    @classmethod
    def of(cls, seqs: list[Sequence]) -> "SamplerFlags":
        params = [s.params for s in seqs]
        return cls(any(p.top_k or p.top_p < 1 or p.min_p > 0 for p in params),
                   any(p.logprob_mode == "raw" for p in params), max(p.top_logprobs for p in params))


# Decode steps of at most this many rows also replay the sampler from a CUDA graph (one per bucket and sampler
# flags, captured on first use): at a few rows its two dozen small kernels cost more host time than GPU time.
# Larger steps sample eagerly (their GPU step hides the host work, and the graphs' buffers would grow with the
# vocabulary times the rows).
SAMPLER_GRAPH_ROWS = 16


BLOCK_SIZE = 16  # positions per KV-cache block


def fitting_blocks(model: MoETransformer, wanted: int, block_size: int = BLOCK_SIZE,
                   memory_fraction: float = 0.8) -> int:
    """How many KV-cache blocks of `block_size` positions (keys, values, routing) to allocate: `wanted`, or on a
    GPU as many as fit in `memory_fraction` of the memory this process may still take (the rest is for
    activations and CUDA graphs): the GPU's free memory, and no more than what its memory share leaves
    (`local_gpus`: the allocator is capped, so a cache sized from the device's free memory would not fit)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return wanted
    c = model.config
    per_block = block_size * c.num_hidden_layers * (
        2 * c.num_key_value_heads * c.head_dim * model.lm_head.weight.element_size()
        + c.num_experts_per_tok * (1 if c.num_experts <= 256 else 2))
    free, total = torch.cuda.mem_get_info(device)
    share_left = torch.cuda.get_per_process_memory_fraction(device) * total - torch.cuda.memory_reserved(device)
    return max(1, min(wanted, int(min(free, share_left) * memory_fraction) // per_block - 1))


def graph_buckets(slots: int) -> list[int]:
    """Batch sizes that decode steps are padded to (one CUDA graph each): 1, 2, 4, 8, then every 16 up to 256,
    every 64 up to 1,024, every 256 beyond; the last is `slots`."""
    sizes = [b for b in (1, 2, 4, 8) if b < slots]
    step = 16
    while not sizes or sizes[-1] < slots:
        nxt = (sizes[-1] // step + 1) * step if sizes else step
        sizes.append(min(nxt, slots))
        step = 16 if sizes[-1] < 256 else 64 if sizes[-1] < 1024 else 256
    return sizes


class Decoder:
    """Continuous batching over a paged KV cache. Not thread-safe: one thread (the engine's loop) calls it.

    `slots` rows run at most at once, each up to `max_len` positions; their keys and values live in a pool of
    `blocks` blocks of `block_size` positions (default: enough for every row at `max_len`), granted as a row
    grows and returned when it finishes or is cancelled, so memory follows the tokens present. Admission needs the
    blocks of a row's prompt and leaves those the decoding rows take next; when decoding rows still need more blocks
    than are free, the newest rows are preempted: their blocks are returned and they wait at the head of the queue
    to be prefilled again (prompt + tokens so far) and continue where they were, with the same draws (their
    randomness is counted by (seed, row, step)).

    On a GPU, decode steps replay CUDA graphs, one per batch bucket (`graph_buckets`): a step's rows are padded
    to the next bucket with the scratch slot, and the graph gathers their tokens and positions from the device
    state and reads the block tables (static device tensors), so the only host work of a step is the slot list in,
    any new table entries, and the sampled tokens out."""

    def __init__(self, model: MoETransformer, *, slots: int, max_len: int, eos_ids: Iterable[int],
                 prefill_tokens: int = 4096, cuda_graphs: bool = True, buckets: list[int] | None = None,
                 blocks: int | None = None, block_size: int = BLOCK_SIZE) -> None:
        self.model, self.eos_ids = model, frozenset(eos_ids)
        self.prefill_tokens = prefill_tokens
        param = next(model.parameters())
        self.device = param.device
        if self.device.type == "cuda":
            share_qkv_weights(model)
        blocks = slots * -(-max_len // block_size) if blocks is None else blocks
        self.cache = PagedCache.allocate(model.config, slots, max_len, blocks, block_size, self.device, param.dtype)
        self.state = SlotState.allocate(slots, self.device)
        self.free = list(range(slots - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[SharedPrefill] = []
        self.decoding: list[Sequence] = []  # rows whose last sampled token is still to be fed
        self.length = [0] * (slots + 1)  # positions filled per slot (host copy of what the cache holds)
        self.preemptions = 0
        self._preemptions_taken = 0  # the part of `preemptions` take_preemptions() has handed out
        self._admissions = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        # (bucket, filtered, any_raw) -> (graph, packed [bucket, 2] float64 (token, logprob) of every row)
        self.sampler_graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self.pool = None
        self.graph_slots: dict[int, tuple[int, ...]] = {}  # what each bucket's slot input holds
        if cuda_graphs and self.device.type == "cuda" and model.ep is None:
            self._capture(buckets or graph_buckets(slots))

    @classmethod
    def in_free_memory(cls, model: MoETransformer, *, slots: int, max_len: int, eos_ids: Iterable[int]) -> "Decoder":
        """A decoder whose block pool holds every row at `max_len`, or on a GPU as many blocks as fit its free
        memory (then rows wait for blocks, and decoding rows may be preempted)."""
        wanted = slots * -(-max_len // BLOCK_SIZE)
        blocks = fitting_blocks(model, wanted)
        if blocks < wanted:
            log.warning("KV cache: %d blocks of %d positions fit in this GPU's free memory, %d rows of %d positions "
                        "would need %d; rows wait for free blocks", blocks, BLOCK_SIZE, slots, max_len, wanted)
        return cls(model, slots=slots, max_len=max_len, eos_ids=eos_ids, blocks=blocks)

    @property
    def slots(self) -> int:
        return self.cache.scratch

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def running(self) -> int:
        return sum(len(g.rows) for g in self.prefilling) + len(self.decoding)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def stats(self) -> dict[str, int]:
        """KV-cache blocks (total, used, free, positions per block) and preemptions so far."""
        return {**self.cache.stats(), "preemptions": self.preemptions}

    def take_preemptions(self) -> int:
        """Preemptions since the last call (a counter metric adds them: a decoder built anew starts from zero
        without the caller keeping a baseline)."""
        new, self._preemptions_taken = self.preemptions - self._preemptions_taken, self.preemptions
        return new

    def add(self, request: RowRequest) -> Sequence:
        """Queue a row; it is admitted when a slot and its prompt's blocks are free. Raises ValueError if it can
        never fit."""
        need = len(request.prompt_ids) + 1
        if need > self.max_len:
            raise ValueError(f"prompt_ids: {len(request.prompt_ids)} tokens; this engine holds at most "
                             f"{self.max_len - 1} prompt tokens per row")
        longest = self.cache.blocks_for(min(len(request.prompt_ids) + request.params.max_tokens, self.max_len))
        if longest > self.cache.blocks:
            raise ValueError(f"max_tokens: {request.params.max_tokens} with {len(request.prompt_ids)} prompt tokens "
                             f"needs {longest} KV-cache blocks of {self.cache.block_size} positions; this engine "
                             f"has {self.cache.blocks}")
        vocab = self.model.config.vocab_size
        if max(request.prompt_ids) >= vocab:
            raise ValueError(f"prompt_ids: token id {max(request.prompt_ids)} is outside [0, {vocab})")
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(64)
        seq = Sequence(request, seed, self.eos_ids | frozenset(request.params.stop_token_ids),
                       top_logprobs=[] if request.params.top_logprobs else None)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> bool:
        """Finish `seq` with "abort" if it has not finished; True if it was still going. A cancelled row in a
        group's shared prefill keeps its slot until that prefill ends (the others still need it)."""
        if seq.finish_reason is not None:
            return False
        seq.finish_reason = "abort"
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.decoding:
            self.decoding.remove(seq)
            self._release(seq)
        else:
            for group in self.prefilling:
                if all(r.finish_reason is not None for r in group.rows):
                    self.prefilling.remove(group)
                    for r in group.rows:
                        self._release(r, keep_routing=False)
                    break
        return True

    @torch.no_grad()
    def step(self, *, agree: Callable[[bool], bool] | None = None) -> StepEvents:
        """One step: admit waiting rows into free slots and blocks, run one prefill chunk if any prompt is being
        prefilled, then one decode forward for every row with a token to feed. On an expert-parallel server every
        rank must join every forward (the MoE layers exchange tokens): `agree(this rank has work)` says whether any
        rank has, and a rank without work then feeds one token of its scratch slot."""
        events = StepEvents([], [])
        self._admit()
        if agree(bool(self.prefilling)) if agree is not None else self.prefilling:
            self._prefill_chunk(events)
        if agree(bool(self.decoding)) if agree is not None else self.decoding:
            with decode_phase(self.model.ep):  # an expert-parallel server's decode dispatcher (DeepEP low-latency)
                self._decode(events)
        return events

    # ---- internals ---------------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Move waiting rows into free slots, in order, a context's consecutive rows as one group (one prefill):
        the leader gets its context's blocks, each other row shares the full ones and gets a block for a copy of
        the partial last one. Stops at the first row whose blocks are not free, leaving the blocks that the decoding
        rows take at their next step (so an admission does not preempt them)."""
        if not (self.waiting and self.free):
            return
        admitted = []
        cache = self.cache
        spare = sum(map(self._needs_block, self.decoding))
        while self.waiting and self.free:
            context = self.waiting[0].context
            full, partial = divmod(len(context), cache.block_size)
            group = SharedPrefill([])
            while self.waiting and self.free and self.waiting[0].context == context:
                need = (full + (partial > 0)) if not group.rows else int(partial > 0)
                if len(cache.free) < need + spare:
                    break
                seq = self.waiting.popleft()
                seq.slot = self.free.pop()
                self._admissions += 1
                seq.admitted = self._admissions
                self.length[seq.slot] = 0
                if group.rows:
                    cache.share(group.rows[0].slot, seq.slot, full)
                cache.grow(seq.slot, len(context))
                group.rows.append(seq)
            if not group.rows:
                break
            self.prefilling.append(group)
            admitted += group.rows
            if self.waiting and self.waiting[0].context == context:  # the group was cut short by blocks
                break
        if admitted:
            self.state.admit(admitted)

    def _prefill_chunk(self, events: StepEvents) -> None:
        """Prefill up to `prefill_tokens` context tokens of the groups in order, packed into one forward with no
        padding (each group's chunk at its leader's slot)."""
        if not self.prefilling:  # an idle expert-parallel rank: one scratch token keeps it in step
            self._scratch_forward()
            return
        budget, chunks = self.prefill_tokens, []
        for group in self.prefilling:
            take = min(len(group.context) - group.prefilled, budget)
            if take <= 0:
                break
            chunks.append((group, take))
            budget -= take
        tokens, slots, positions, segments, last = [], [], [], [], []
        for group, take in chunks:
            segments.append((len(tokens), take))
            tokens += group.context[group.prefilled:group.prefilled + take]
            slots += [group.rows[0].slot] * take
            positions += range(group.prefilled, group.prefilled + take)
            last.append(len(tokens) - 1)
        dev = self.device
        scored = [i for i, (g, _) in enumerate(chunks)
                  if any(r.params.prompt_logprobs and r.prompt_logprobs is None for r in g.rows)]
        for i in scored:  # every position of a scored chunk: its logits score the prompt token after it
            first, take = segments[i]
            last += range(first, first + take)
        packed = torch.tensor([tokens, slots, positions], dtype=torch.long)
        packed = (packed.pin_memory() if dev.type == "cuda" else packed).to(dev, non_blocking=True)
        fused = dev.type == "cuda"
        tiles = None
        if fused:
            from moe_rl_eks.kernels.prefill_attention import prefill_tiles

            tiles = prefill_tiles(segments, dev)
        self.cache.sync_tables()
        logits = forward_tokens(self.model, self.cache, packed[1], packed[0], packed[2],
                                torch.tensor(last, device=dev), max(g.prefilled + take for g, take in chunks),
                                fused, tiles)
        if scored:
            per_chunk = logits[len(chunks):].split([segments[i][1] for i in scored])
            self._score_prompts([chunks[i] for i in scored], per_chunk)
            logits = logits[:len(chunks)]
        done, done_logits = [], []
        for i, (group, take) in enumerate(chunks):
            group.prefilled += take
            self.length[group.rows[0].slot] = group.prefilled
            if group.prefilled == len(group.context):
                done.append(group)
                done_logits.append(i)
        if not done:
            return
        rows, which = [], []
        for group, i in zip(done, done_logits):
            self.prefilling.remove(group)
            leader, length = group.rows[0].slot, group.prefilled
            full, partial = divmod(length, self.cache.block_size)
            for r in group.rows:
                if partial and r.slot != leader:
                    self.cache.copy_block(leader, r.slot, full)
                self.length[r.slot] = length
                if r.params.prompt_logprobs and r.prompt_logprobs is None:  # (a recomputed row has them)
                    # the first prompt token has nothing before it to be scored on
                    n = r.params.top_logprobs
                    r.prompt_logprobs = [None, *group.prompt_logprobs]
                    r.prompt_top_logprobs = [None, *(alts[:n] for alts in group.prompt_top_logprobs)] if n else None
                if r.finish_reason is None:
                    rows.append(r)
                    which.append(i)
                else:  # cancelled while its group prefilled
                    self._release(r, keep_routing=False)
        if rows:
            slots = torch.tensor([r.slot for r in rows], device=dev)
            self.state.length[slots] = torch.tensor([self.length[r.slot] for r in rows], device=dev)
            self._sample(rows, slots, logits[torch.tensor(which, device=dev)], events)

    def _score_prompts(self, chunks: list[tuple[SharedPrefill, int]], logits: Iterable[torch.Tensor]) -> None:
        """Logprobs of each group's prompt tokens that this chunk's positions predict (`logits` [take, V] per
        group, before `prefilled` moves): position p scores prompt token p + 1, under softmax(logits)."""
        top_n = max(r.params.top_logprobs for g, _ in chunks for r in g.rows if r.params.prompt_logprobs)
        for (group, take), chunk in zip(chunks, logits):
            targets = group.context[group.prefilled + 1:group.prefilled + take + 1]  # the last position: a new token
            if not targets:
                continue
            logp = torch.log_softmax(chunk[:len(targets)].float(), -1)
            chosen = logp.gather(-1, torch.tensor(targets, device=logp.device)[:, None])[:, 0]
            group.prompt_logprobs += chosen.tolist()
            if top_n:
                values, ids = logp.topk(top_n, -1)
                group.prompt_top_logprobs += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]

    def _decode_forward(self, slot: torch.Tensor, key_len: int) -> torch.Tensor:
        """Feed each slot's last sampled token at its length; what a CUDA graph captures (static shapes)."""
        start = self.state.length[slot]
        tokens = self.state.last_token[slot]
        rows = torch.arange(slot.shape[0], device=slot.device)
        logits = forward_tokens(self.model, self.cache, slot, tokens, start, rows, key_len)
        self.state.length[slot] = start + 1
        self.state.length[self.slots:].zero_()  # padding rows fed the scratch slot (a kernel, no host copy)
        return logits

    def _capture(self, buckets: list[int]) -> None:
        """One CUDA graph per bucket, largest first so the smaller ones reuse its memory pool. Each bucket runs
        eagerly first (kernel autotuning and compilation happen outside the capture)."""
        try:
            self._capture_buckets(buckets)
        except RuntimeError as exc:  # an op that cannot be captured: decode eagerly, slower but right (e.g. the
            # torch backend's float32 experts loop over a host copy of the expert counts; bf16 uses a grouped GEMM)
            log.warning("decode steps run without CUDA graphs: capturing them failed: %s", str(exc).splitlines()[0])
            self.graphs, self.sampler_graphs = {}, {}

    def _capture_buckets(self, buckets: list[int]) -> None:
        pool = self.pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            for size in sorted(set(buckets), reverse=True):
                slot = torch.full((size,), self.slots, dtype=torch.long, device=self.device)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._decode_forward(slot, self.max_len)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._decode_forward(slot, self.max_len)
                self.graphs[size] = (graph, slot, logits)
                if size <= SAMPLER_GRAPH_ROWS:  # plain sampling (RL's temperature-only rows) ready from the start
                    self._capture_sampler(size, SamplerFlags(filtered=False, any_raw=False, top_n=0))
        torch.cuda.synchronize(self.device)

    def _scratch_forward(self) -> None:
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        forward_tokens(self.model, self.cache, zero + self.slots, zero, zero, zero, 1)

    def _grow(self, rows: list[Sequence]) -> list[Sequence]:
        """Grant each row the block its next position needs; while more rows need one than blocks are free,
        preempt the newest row. Returns the rows that keep decoding, oldest first."""
        cache = self.cache
        rows = sorted(rows, key=lambda r: r.admitted)
        needing = {id(r) for r in rows if self._needs_block(r)}
        while rows and len(needing) > len(cache.free):
            victim = rows.pop()
            needing.discard(id(victim))
            self._preempt(victim)
        for r in rows:
            if id(r) in needing:
                cache.grow(r.slot, self.length[r.slot] + 1)
        return rows

    def _needs_block(self, seq: Sequence) -> bool:
        """Whether a decoding row's next position starts a block it does not hold yet."""
        return self.length[seq.slot] >= len(self.cache.owned[seq.slot]) * self.cache.block_size

    def _preempt(self, seq: Sequence) -> None:
        """Take a decoding row's blocks back; it waits at the head of the queue to be recomputed."""
        log.info("KV cache full: row %s/%d preempted after %d tokens; it is recomputed when blocks free up",
                 seq.request.request_id, seq.request.row, len(seq.tokens))
        self._release(seq, keep_routing=False)
        seq.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _decode(self, events: StepEvents) -> None:
        rows = self._grow(self.decoding)
        self.decoding = []
        if not rows:  # an idle expert-parallel rank, or every row preempted (blocks held by prefilling rows)
            self._scratch_forward()
            return
        self.cache.sync_tables()
        dev = self.device
        slots = [r.slot for r in rows]
        bucket = next((b for b in sorted(self.graphs) if b >= len(slots)), None)
        if bucket is not None:
            graph, slot_in, logits = self.graphs[bucket]
            padded = tuple(slots) + (self.slots,) * (bucket - len(slots))
            if self.graph_slots.get(bucket) != padded:  # steady decoding feeds the same slots: no copy
                slot_in.copy_(torch.tensor(padded).pin_memory(), non_blocking=True)
                self.graph_slots[bucket] = padded
            graph.replay()
            slot, logits = slot_in[:len(slots)], logits[:len(slots)]
        else:
            slot = torch.tensor(slots, device=dev)
            logits = self._decode_forward(slot, max(self.length[s] for s in slots) + 1)
        for r in rows:
            self.length[r.slot] += 1
        self._sample(rows, slot, logits, events, bucket)

    def _sample_packed(self, slot: torch.Tensor, logits: torch.Tensor, flags: SamplerFlags) -> torch.Tensor:
        """Sample a token for each slot of `slot`, advance their state, and return [B, 2 + 2 top_n] float64:
        token (exact in float64), logprob, then the top alternatives' ids and logprobs (one copy to the host)."""
        out = sample(logits, self.state.sampling(slot, flags))
        self.state.last_token[slot] = out.tokens
        self.state.step[slot] += 1
        packed = [out.tokens.double()[:, None], out.logprobs.double()[:, None]]
        if flags.top_n:
            packed += [out.top_ids.double(), out.top_logprobs.double()]
        return torch.cat(packed, 1)

    def _sampler_graph(self, bucket: int | None, flags: SamplerFlags) -> torch.Tensor | None:
        """Replay the sampler of decode bucket `bucket` (capturing it on first use); its packed output, or None
        where the sampler runs eagerly."""
        if bucket is None or bucket > SAMPLER_GRAPH_ROWS or flags.top_n:
            return None
        key = (bucket, flags.filtered, flags.any_raw)
        if key not in self.sampler_graphs:
            try:
                self._capture_sampler(bucket, flags)
            except RuntimeError as exc:  # sample eagerly from now on for these flags: slower but right
                log.warning("the sampler runs without a CUDA graph: capturing it failed: %s", str(exc).splitlines()[0])
                self.sampler_graphs[key] = None
        if self.sampler_graphs[key] is None:
            return None
        graph, packed = self.sampler_graphs[key]
        graph.replay()
        return packed

    def _capture_sampler(self, bucket: int, flags: SamplerFlags) -> None:
        _, slot_in, logits = self.graphs[bucket]
        scratch = torch.full_like(slot_in, self.slots)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up (kernel compilation) on the scratch slot only
            self._sample_packed(scratch, logits, flags)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            packed = self._sample_packed(slot_in, logits, flags)
        self.sampler_graphs[(bucket, flags.filtered, flags.any_raw)] = (graph, packed)

    def _sample(self, rows: list[Sequence], slot: torch.Tensor, logits: torch.Tensor, events: StepEvents,
                bucket: int | None = None) -> None:
        flags = SamplerFlags.of(rows)
        packed = self._sampler_graph(bucket, flags)
        if packed is None:
            packed = self._sample_packed(slot, logits, flags)
        host = packed[:len(rows)].cpu().tolist()
        top_n = flags.top_n
        for r, values in zip(rows, host):
            token, logprob = int(values[0]), values[1]
            top = None
            if r.params.top_logprobs:
                n = r.params.top_logprobs
                # alternatives the filters cut (logprob -inf under the processed distribution) are left out
                top = [(int(t), lp) for t, lp in zip(values[2:2 + n], values[2 + top_n:2 + top_n + n])
                       if lp != float("-inf")]
                r.top_logprobs.append(top)
            r.tokens.append(token)
            r.logprobs.append(logprob)
            events.sampled.append((r, token, logprob, top))
            if token in r.stop_ids:
                r.finish_reason = "stop"
            elif len(r.tokens) >= r.params.max_tokens or self.length[r.slot] >= self.max_len:
                r.finish_reason = "length"
            if r.finish_reason is None:
                self.decoding.append(r)
            else:
                events.finished.append(r)
                self._release(r)

    def _release(self, seq: Sequence, keep_routing: bool = True) -> None:
        """Free a finished row's slot and blocks; first keep (on the device) the expert ids of its fed positions,
        prompt + completion[:-1], if it asked for them."""
        if seq.slot is None:
            return
        if keep_routing and seq.params.return_routing:
            seq.routing = self.cache.routing_of(seq.slot, self.length[seq.slot])
        self.cache.release(seq.slot)
        self.free.append(seq.slot)
        seq.slot = None


def output(seq: Sequence, version: int | None, lineage: int | None) -> RowOutput:
    """A finished row as the engine reports it; its routing leaves the device here, as [positions, layers, k]."""
    routing = seq.routing.cpu().numpy() if seq.routing is not None else None
    return RowOutput(seq.request.request_id, seq.request.row, list(seq.tokens), list(seq.logprobs),
                     seq.top_logprobs, seq.finish_reason, seq.error, routing, version, lineage or 0,
                     seq.prompt_logprobs, seq.prompt_top_logprobs)


# ---- one-shot decoding of a list of rows --------------------------------------------------------------------
@dataclass
class Row:
    """A row for `generate`, the one-shot API (local evaluation, tests): plain sampling fields."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    want_routing: bool = False


@dataclass
class RowResult:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False  # ended with end-of-sequence (else cut off at max_tokens)
    # per MoE layer, per fed position (prompt, then completion tokens but the last), the expert ids
    routing: list[list[list[int]]] | None = None


@torch.no_grad()
def decode_all(model: MoETransformer, requests: list[RowRequest], eos_ids: Iterable[int]) -> list[Sequence]:
    """Decode `requests` to the end in one decoder sized for them (local evaluation, tests)."""
    decoder = Decoder(model, slots=len(requests), max_len=max(len(r.prompt_ids) + r.params.max_tokens for r in requests),
                      eos_ids=eos_ids, prefill_tokens=sum(len(r.prompt_ids) for r in requests))
    seqs = [decoder.add(r) for r in requests]
    while decoder.busy:
        decoder.step()
    return seqs


def generate(model: MoETransformer, rows: list[Row], eos_id: int) -> list[RowResult]:
    """`decode_all` for plain rows (tests, bench-generation); routing as nested lists [layers][positions][k]."""
    requests = [RowRequest(tuple(r.prompt), SamplingParams(r.max_tokens, r.temperature, r.top_p, seed=r.seed,
                                                           return_routing=r.want_routing), str(i), 0)
                for i, r in enumerate(rows)]
    return [RowResult(s.tokens, s.logprobs, s.finish_reason == "stop",
                      s.routing.transpose(0, 1).tolist() if s.routing is not None else None)
            for s in decode_all(model, requests, [eos_id])]
