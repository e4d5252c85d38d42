"""The exact mode's attention: a query's output is the same bits when it is decoded over the paged KV cache (alone,
among 3 or among 17 rows, any position, any neighbours; a row's chunks of positions walked by one program or each
given its own and merged by a second launch), prefilled over it in chunks, and computed as the trainer's packed
causal forward does (the sequences back to back, read as blocks of one position); and it is softmax attention."""
import math

import pytest
import torch

from moe_rl_eks.kernels._triton import INTERPRET, multiprocessors
from moe_rl_eks.kernels.invariant_attention import CHUNK, chunk_programs, invariant_decode_attention, \
    invariant_prefill_attention
from moe_rl_eks.kernels.prefill_attention import prefill_tiles

from invariance import ROWS, assert_rows_invariant

DEVICE = "cpu" if INTERPRET else "cuda"  # compiled on a GPU with --noconftest
SCALE = CHUNK // 32  # 1 under the interpreter, 8 compiled (its chunks of 256 positions)
PAGE = 8 * SCALE
# several key tiles and chunks, a partial one; one short sequence; a tile boundary inside
LENGTHS = [37 * SCALE, 5, 20 * SCALE]
TABLES = [[4, 9, 0, 7, 2], [10, 11, 11, 11, 11], [3, 8, 6, 11, 11]]  # scattered, out of order; block 11: nobody's


def sequences(dtype, heads=4, kv_heads=2, dim=32):
    torch.manual_seed(0)
    n = sum(LENGTHS)
    return (torch.randn(n, heads, dim).to(dtype).to(DEVICE), torch.randn(n, kv_heads, dim).to(dtype).to(DEVICE),
            torch.randn(n, kv_heads, dim).to(dtype).to(DEVICE))


def cached(k, v):
    """The sequences' keys and values in a paged pool (every position no sequence holds is NaN), their tables,
    and each token's slot and position."""
    keys = torch.full((12, PAGE, *k.shape[1:]), float("nan"), dtype=k.dtype, device=DEVICE)
    values = keys.clone()
    tables = torch.tensor(TABLES, dtype=torch.int32, device=DEVICE)
    slots = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).to(DEVICE)
    block, offset = tables[slots, positions // PAGE].long(), positions % PAGE
    keys[block, offset], values[block, offset] = k, v
    return keys, values, tables, slots, positions


def packed_causal_attention(q, k, v):
    """The trainer's layout: token t's keys at block t of one position; sequence s's position p at block
    starts[s] + p; one prefill over all the sequences."""
    lengths = torch.tensor(LENGTHS)
    starts = torch.cumsum(lengths, 0) - lengths
    tables = (starts[:, None] + torch.arange(max(LENGTHS))).clamp(max=sum(LENGTHS) - 1).to(torch.int32)
    slots = torch.repeat_interleave(torch.arange(len(LENGTHS)), lengths)
    positions = torch.arange(sum(LENGTHS)) - starts[slots]
    tiles = prefill_tiles([(int(s), n) for s, n in zip(starts, LENGTHS)], DEVICE)
    return invariant_prefill_attention(q, k.unsqueeze(1), v.unsqueeze(1), tables.to(DEVICE), slots.to(DEVICE),
                                       positions.to(DEVICE), tiles)


def reference(q, k, v):
    out, first = [], 0
    for n in LENGTHS:
        qs, ks, vs = (t[first:first + n].double().transpose(0, 1) for t in (q, k, v))
        group = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(qs.shape[-1])
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        first += n
    return torch.cat(out)


def test_the_sequences_span_several_chunks_and_decode_chooses_chunk_programs_only_at_a_few_rows():
    assert max(LENGTHS) > CHUNK > min(LENGTHS)
    device = torch.device(DEVICE)
    sms = 3 if INTERPRET else multiprocessors(0)  # the interpreter's stand-in count
    wide = len(TABLES[0]) * PAGE  # the tables' width: the positions a decode step's programs cover
    assert chunk_programs(1, 4, 2, 32, wide, device)  # 2 programs walking would leave multiprocessors idle
    assert not chunk_programs(-(-sms // 2), 4, 2, 32, wide, device)  # a walk's programs fill them
    assert not chunk_programs(1, 4, 2, 32, CHUNK, device)  # one chunk: nothing to spread
    assert not chunk_programs(1, 4, 2, 32, CHUNK << 17, device)  # partial softmaxes over PARTIALS_MAX_BYTES


SMALL = (4, 2, 32)  # heads, kv heads, head dim
# Qwen3-30B-A3B's: 8 query heads a kv head, 128 wide, whose decode tile is half the prefill's on half the warps
# (prefill_attention.decode_tile); a property of the compiled tiles, which the interpreter's dot does not have
QWEN3_30B = pytest.param(torch.bfloat16, 2e-2, None, (32, 4, 128), id="bf16-chosen-30b-heads",
                         marks=pytest.mark.skipif(INTERPRET, reason="the compiled tiles' property"))


@pytest.mark.parametrize("dtype, tol, split, shape", [
    pytest.param(torch.bfloat16, 2e-2, None, SMALL, id="bf16-chosen"),
    pytest.param(torch.bfloat16, 2e-2, True, SMALL, id="bf16-chunk-programs"),
    pytest.param(torch.bfloat16, 2e-2, False, SMALL, id="bf16-walk"),
    pytest.param(torch.float32, 1e-5, None, SMALL, id="fp32-chosen"), QWEN3_30B])
def test_decode_over_the_paged_cache_equals_the_packed_causal_forward_bitwise_in_any_batch(dtype, tol, split, shape):
    q, k, v = sequences(dtype, *shape)
    packed = packed_causal_attention(q, k, v)
    want = reference(q, k, v)
    assert packed.dtype == dtype and not packed.isnan().any()
    assert ((packed.double() - want).norm() / want.norm()).item() < tol
    keys, values, tables, slots, positions = cached(k, v)
    # the queries under test: 17 tokens over all three sequences (first, last, tile and chunk edges); the rest are
    # neighbours
    edges, starts = (0, 1, 15, 16, 17, CHUNK - 1, CHUNK, CHUNK + 1), [0, LENGTHS[0], LENGTHS[0] + LENGTHS[1]]
    tested = [s + p for s, n in zip(starts, LENGTHS) for p in dict.fromkeys([*edges, n - 1]) if p < n]
    pool = torch.tensor((tested + [t for t in range(sum(LENGTHS)) if t not in tested])[:2 * ROWS], device=DEVICE)
    decoded = assert_rows_invariant(lambda batch: invariant_decode_attention(
        q[pool[batch]], keys, values, tables, slots[pool[batch]], positions[pool[batch]] + 1, split=split))
    assert torch.equal(decoded, packed[pool[:ROWS]])


def test_a_chunked_prefill_over_the_paged_cache_equals_the_packed_causal_forward_bitwise():
    q, k, v = sequences(torch.bfloat16)
    packed = packed_causal_attention(q, k, v)
    keys, values, tables, slots, positions = cached(k, v)
    # two prefill chunks of (first token, count) runs: sequence 0's first `cut` positions with all of sequence 1,
    # then sequence 0's others (over the keys the first chunk cached) with all of sequence 2
    cut, (n0, n1, n2) = 21 * SCALE, LENGTHS
    for runs in ([(0, cut), (n0, n1)], [(cut, n0 - cut), (n0 + n1, n2)]):
        at = torch.cat([torch.arange(first, first + count) for first, count in runs]).to(DEVICE)
        local = [(0, runs[0][1]), (runs[0][1], runs[1][1])]
        got = invariant_prefill_attention(q[at], keys, values, tables, slots[at], positions[at],
                                          prefill_tiles(local, DEVICE))
        assert torch.equal(got, packed[at])
