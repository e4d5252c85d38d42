"""One uniform per row from (seed, row, step) in one kernel: Philox4x32-10 (Salmon et al., Random123) on the
counter (step low word, row, step high word, 0) with the seed's two 32-bit words as the key, word 0's top 24 bits
scaled to [0, 1). The rollout engine's sampler draws with it on the GPU; the same function written with tensor ops
(workloads/rollout/sampler.py) is a hundred small launches per step."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import check_device


@triton.jit
def _row_uniform_kernel(key_lo_ptr, key_hi_ptr, row_ptr, step_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    k0 = tl.load(key_lo_ptr + i, mask=ok, other=0).to(tl.uint32)
    k1 = tl.load(key_hi_ptr + i, mask=ok, other=0).to(tl.uint32)
    step = tl.load(step_ptr + i, mask=ok, other=0)
    c0 = (step & 0xFFFFFFFF).to(tl.uint32)
    c1 = (tl.load(row_ptr + i, mask=ok, other=0) & 0xFFFFFFFF).to(tl.uint32)
    c2 = ((step >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c3 = tl.zeros_like(c0)
    m0 = tl.full(c0.shape, 0xD2511F53, tl.uint32)
    m1 = tl.full(c0.shape, 0xCD9E8D57, tl.uint32)
    w0 = tl.full(c0.shape, 0x9E3779B9, tl.uint32)
    w1 = tl.full(c0.shape, 0xBB67AE85, tl.uint32)
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + w0
            k1 = k1 + w1
        hi0, lo0 = tl.umulhi(c0, m0), c0 * m0
        hi1, lo1 = tl.umulhi(c2, m1), c2 * m1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    tl.store(out_ptr + i, (c0 >> 8).to(tl.float32) * (1.0 / (1 << 24)), mask=ok)


def row_uniform(key_lo: torch.Tensor, key_hi: torch.Tensor, row: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[B] int64 seed words (each < 2**32), rows and steps -> [B] float32 uniforms in [0, 1)."""
    for name, t in (("key_lo", key_lo), ("key_hi", key_hi), ("row", row), ("step", step)):
        check_device(name, t)
    n = key_lo.numel()
    out = torch.empty(n, device=key_lo.device, dtype=torch.float32)
    if n:
        args = (t.to(torch.int64).contiguous() for t in (key_lo, key_hi, row, step))
        _row_uniform_kernel[(triton.cdiv(n, 256),)](*args, out, n, BLOCK=256)
    return out
