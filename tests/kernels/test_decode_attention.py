"""The decode attention kernel reads each row's own slot up to its length and equals softmax attention there."""
import math

import pytest
import torch

from moe_rl_eks.kernels.decode_attention import decode_attention


def reference(q, keys, values, slots, lengths):
    out = []
    for b in range(q.shape[0]):
        k = keys[slots[b], :lengths[b]].double()  # [n, H_kv, D]
        v = values[slots[b], :lengths[b]].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) / math.sqrt(q.shape[-1])
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_attention_equals_softmax_attention_over_each_rows_valid_positions(dtype, tol, splits):
    torch.manual_seed(0)
    slots_total, max_len, kv_heads, dim = 5, 40, 2, 32
    keys = torch.randn(slots_total, max_len, kv_heads, dim).to(dtype)
    values = torch.randn(slots_total, max_len, kv_heads, dim).to(dtype)
    slots = torch.tensor([3, 0, 4, 1])
    lengths = torch.tensor([1, 17, 40, 33])  # one position, a partial block, the whole slot, split boundaries
    q = torch.randn(4, 8, dim).to(dtype)
    # poison what no row may read: positions past each length, and the slot nobody uses
    for b in range(4):
        keys[slots[b], lengths[b]:] = float("nan")
        values[slots[b], lengths[b]:] = float("nan")
    keys[2], values[2] = float("nan"), float("nan")
    got = decode_attention(q, keys, values, slots, lengths, splits)
    want = reference(q, keys, values, slots, lengths)
    assert got.dtype == dtype and not got.isnan().any()
    assert ((got.double() - want).norm() / want.norm()).item() < tol
