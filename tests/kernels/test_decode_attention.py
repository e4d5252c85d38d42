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


def test_the_engines_decode_forward_with_these_kernels_equals_its_plain_forward():
    import copy
    import dataclasses

    from moe_rl_eks.workloads.model import MoETransformer
    from moe_rl_eks.workloads.rl.bench_rollout import TINY
    from moe_rl_eks.workloads.rl.generation import SlotCache, forward_slots

    torch.manual_seed(0)
    model = MoETransformer(dataclasses.replace(TINY, head_dim=16)).eval()
    cache = SlotCache.allocate(model.config, 3, 24, "cpu", torch.float32)
    slot, start = torch.tensor([2, 0]), torch.tensor([0, 0])
    with torch.no_grad():  # two prompts of 7 and 4 tokens, then one decode step each
        forward_slots(model, cache, slot, torch.randint(0, 512, (2, 7)), start, torch.tensor([7, 4]), 7, False)
        results = []
        for fused in (False, True):
            c = copy.deepcopy(cache)
            logits = forward_slots(model, c, slot, torch.tensor([[5], [9]]), torch.tensor([7, 4]),
                                   torch.ones(2, dtype=torch.long), 8, fused)
            results.append((logits, c))
    (plain, a), (fused, b) = results
    assert ((fused - plain).norm() / plain.norm()).item() < 1e-5
    assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.equal(a.routing, b.routing)
