"""Write a forward's new keys and values into the rollout engine's paged KV cache in one launch (instead of one
indexed copy each): token n's k [H_kv, D] and v go to block `blocks[n]`, offset `offsets[n]`.

Layouts: k, v [N, H_kv, D] (any strides with a unit last one); keys/values [blocks, block_size, H_kv, D] contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import check_device, next_pow2


@triton.jit
def _write_kernel(k_ptr, v_ptr, keys_ptr, values_ptr, block_ptr, offset_ptr, stride_kn, stride_kh, stride_vn,
                  stride_vh, stride_cb, stride_cn, stride_ch, H: tl.constexpr, D: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    n = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    ok = (h < H)[:, None]
    at = tl.load(block_ptr + n).to(tl.int64) * stride_cb + tl.load(offset_ptr + n).to(tl.int64) * stride_cn
    dest = at + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + n * stride_kn + h[:, None] * stride_kh + d[None, :], mask=ok)
    v = tl.load(v_ptr + n * stride_vn + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(keys_ptr + dest, k, mask=ok)
    tl.store(values_ptr + dest, v, mask=ok)


def write_kv(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
             offsets: torch.Tensor) -> None:
    """keys[blocks[n], offsets[n]] = k[n] and values[...] = v[n] for every token n."""
    for name, t in (("keys", keys), ("values", values), ("k", k), ("v", v)):
        check_device(name, t)
    tokens, heads, dim = k.shape
    if v.shape != k.shape or keys.shape != values.shape or keys.shape[2:] != (heads, dim) \
            or not (keys.is_contiguous() and values.is_contiguous()) or k.stride(-1) != 1 or v.stride(-1) != 1 \
            or dim != next_pow2(dim):
        raise ValueError(f"write_kv needs k = v [N, H_kv, D] (unit last stride, D a power of two) and contiguous "
                         f"keys = values [blocks, block_size, H_kv, D]; got k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    if tokens:
        _write_kernel[(tokens,)](k, v, keys, values, blocks, offsets, k.stride(0), k.stride(1), v.stride(0),
                                 v.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), H=heads, D=dim,
                                 BLOCK_H=next_pow2(heads))
