"""The paged attention kernels: decode reads each row's own blocks up to its length, prefill attends causally over
packed prompts of several rows; both equal softmax attention there. The engine's forward with them equals its plain
forward."""
import math

import pytest
import torch

from moe_rl_eks.kernels._triton import INTERPRET
from moe_rl_eks.kernels import decode_attention as kernel_module
from moe_rl_eks.kernels.decode_attention import decode_attention
from moe_rl_eks.kernels.prefill_attention import prefill_attention, prefill_tiles

PAGE = 8
# On the CPU through Triton's interpreter (this directory's conftest); compiled on a GPU when run with --noconftest.
DEVICE = "cpu" if INTERPRET else "cuda"


def reference(q, keys, values, tables, slots, lengths):
    """Row b of q [B, H, D] over the first lengths[b] positions of slot slots[b], in float64."""
    out = []
    for b in range(q.shape[0]):
        blocks = tables[slots[b]].long()
        k = keys[blocks].flatten(0, 1)[:lengths[b]].double()  # [n, H_kv, D]
        v = values[blocks].flatten(0, 1)[:lengths[b]].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) / math.sqrt(q.shape[-1])
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def paged(dtype, kv_heads=2, dim=32):
    """A pool of 12 blocks of 8 positions (block 11 poisoned: nobody's), 4 slots' tables of 5 blocks, scattered
    and out of order, slot 3 sharing slot 0's first two blocks."""
    torch.manual_seed(0)
    keys = torch.randn(12, PAGE, kv_heads, dim).to(dtype)
    values = torch.randn(12, PAGE, kv_heads, dim).to(dtype)
    tables = torch.tensor([[4, 9, 0, 7, 2], [10, 1, 11, 11, 11], [3, 8, 6, 5, 11], [4, 9, 11, 11, 11]],
                          dtype=torch.int32)
    keys[11], values[11] = float("nan"), float("nan")
    return keys.to(DEVICE), values.to(DEVICE), tables.to(DEVICE)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_attention_reads_each_rows_blocks_up_to_its_length_and_equals_softmax_attention(dtype, tol, splits):
    keys, values, tables = paged(dtype)
    slots = torch.tensor([3, 0, 2, 1], device=DEVICE)
    lengths = torch.tensor([1, 37, 32, 11], device=DEVICE)  # one position, a partial block, whole blocks, a split
    q = torch.randn(4, 8, 32).to(dtype).to(DEVICE)
    for b in range(4):  # poison what no row may read: positions past each length in its last block
        last = tables[slots[b], (lengths[b] - 1) // PAGE]
        if lengths[b] % PAGE and slots[b] != 3:  # (slot 3's last block is shared with slot 0, which reads it)
            keys[last, lengths[b] % PAGE:], values[last, lengths[b] % PAGE:] = float("nan"), float("nan")
    got = decode_attention(q, keys, values, tables, slots, lengths, splits)
    want = reference(q, keys, values, tables, slots, lengths)
    assert got.dtype == dtype and not got.isnan().any()
    assert ((got.double() - want).norm() / want.norm()).item() < tol
    # q read in place as a view of wider rows (the engine's queries share a row with its keys)
    wide = torch.cat([q, torch.randn(4, 2, 32).to(dtype).to(DEVICE)], 1)
    assert torch.equal(decode_attention(wide[:, :8], keys, values, tables, slots, lengths, splits), got)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_attention_is_causal_within_each_packed_prompt_and_reads_earlier_chunks(dtype, tol):
    keys, values, tables = paged(dtype)
    # packed: slot 0's positions 0-36 (a whole prompt, three tiles), slot 2's positions 20-31 (a later chunk of a
    # prompt whose first 20 positions an earlier chunk wrote), slot 1's single position 0
    runs = [(0, 0, 37), (2, 20, 12), (1, 0, 1)]
    slots = torch.cat([torch.full((n,), s) for s, _, n in runs]).to(DEVICE)
    positions = torch.cat([torch.arange(p, p + n) for _, p, n in runs]).to(DEVICE)
    segments, first = [], 0
    for _, _, n in runs:
        segments.append((first, n))
        first += n
    keys[2, 37 % PAGE:], values[2, 37 % PAGE:] = float("nan"), float("nan")  # slot 0 past its last token
    q = torch.randn(len(slots), 8, 32).to(dtype).to(DEVICE)
    tiles = prefill_tiles(segments, DEVICE)
    got = prefill_attention(q, keys, values, tables, slots, positions, tiles)
    want = reference(q, keys, values, tables, slots, positions + 1)
    assert got.dtype == dtype and not got.isnan().any()
    assert ((got.double() - want).norm() / want.norm()).item() < tol
    # q read in place as a view of wider rows, as the engine's prefill passes it
    wide = torch.cat([q, torch.randn(len(slots), 2, 32).to(dtype).to(DEVICE)], 1)
    assert torch.equal(prefill_attention(wide[:, :8], keys, values, tables, slots, positions, tiles), got)


def test_the_engines_forward_with_these_kernels_equals_its_plain_forward():
    import copy
    import dataclasses

    from moe_rl_eks.workloads.model import MoETransformer
    from moe_rl_eks.tools.bench.rollout import TINY
    from moe_rl_eks.workloads.rollout.kv_cache_manager import PagedCache
    from moe_rl_eks.workloads.rollout.model_runner import ModelRunner

    torch.manual_seed(0)
    model = MoETransformer(dataclasses.replace(TINY, head_dim=16)).eval().to(DEVICE)
    cache = PagedCache.allocate(model.config, 3, 24, 9, 4, DEVICE, torch.float32)
    cache.grow(2, 8)
    cache.grow(0, 5)
    cache.sync_tables()
    slot = torch.tensor([2] * 7 + [0] * 4, device=DEVICE)
    positions = torch.cat([torch.arange(7), torch.arange(4)]).to(DEVICE)
    tokens = torch.randint(0, 512, (11,)).to(DEVICE)
    last = torch.tensor([6, 10], device=DEVICE)
    results = []
    with torch.no_grad():  # two prompts of 7 and 4 tokens packed, then one decode step each
        for fused in (False, True):
            c = copy.deepcopy(cache)
            runner = ModelRunner(model, c, cuda_graphs=False, kernels="triton" if fused else "torch")
            tiles = prefill_tiles([(0, 7), (7, 4)], DEVICE) if fused else None
            prefill = runner.forward(slot, tokens, positions, last, 7, tiles)
            two = torch.tensor([[2, 0], [5, 9], [7, 4], [0, 1]], device=DEVICE)
            decode = runner.forward(*two, 8)
            results.append((prefill, decode, c))
    (prefill, plain, a), (prefill_fused, fused, b) = results
    assert ((prefill_fused - prefill).norm() / prefill.norm()).item() < 1e-5
    assert ((fused - plain).norm() / plain.norm()).item() < 1e-5
    assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.equal(a.routing, b.routing)


def test_after_a_weight_install_a_decoder_on_these_kernels_samples_as_a_fresh_one_on_the_new_weights():
    # the runner's packed q/k/v and q/k-norm buffers are copies: a served version's install must refresh them
    import dataclasses

    from moe_rl_eks.workloads.model import MoETransformer
    from moe_rl_eks.tools.bench.rollout import TINY
    from moe_rl_eks.workloads.rollout.decoder import Decoder
    from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
    from moe_rl_eks.workloads.rollout.weight_staging import install

    torch.manual_seed(0)
    model = MoETransformer(dataclasses.replace(TINY, head_dim=16)).eval().to(DEVICE)
    torch.manual_seed(1)
    version = MoETransformer(model.config).state_dict()
    row = RowRequest((1, 5, 9, 4, 7), SamplingParams(4, seed=3, return_routing=True), "r", 0)

    def decode(decoder):
        seq = decoder.add(row)
        while decoder.busy:
            decoder.step()
        return seq
    served = Decoder(model, slots=1, max_len=16, eos_ids=(), kernels="triton")
    before = decode(served)
    install(model, version)
    served.load_weights()
    after, fresh = decode(served), decode(Decoder(model, slots=1, max_len=16, eos_ids=(), kernels="triton"))
    assert after.logprobs != before.logprobs  # other weights
    assert after.tokens == fresh.tokens and after.logprobs == fresh.logprobs and torch.equal(after.routing,
                                                                                             fresh.routing)


def test_write_kv_puts_each_tokens_keys_and_values_at_its_block_and_offset_and_nowhere_else():
    from moe_rl_eks.kernels.kv_write import write_kv

    keys, values = (torch.zeros(5, PAGE, 2, 32, device=DEVICE) for _ in range(2))
    kv = torch.randn(3, 2, 8, 32, device=DEVICE)  # q/k/v-like strided views: heads not adjacent to tokens
    k, v = kv[:, 0, 1:3], kv[:, 0, 5:7]
    blocks, offsets = torch.tensor([4, 0, 4], device=DEVICE), torch.tensor([7, 0, 1], device=DEVICE)
    want_k, want_v = keys.clone(), values.clone()
    want_k[blocks, offsets], want_v[blocks, offsets] = k, v
    write_kv(keys, values, k, v, blocks, offsets)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


def test_decode_splits_cover_the_multiprocessors_twice_with_at_least_64_positions_a_split(monkeypatch):
    # the GPU's choice, with an H200's 132 multiprocessors: programs = rows x kv heads x splits
    monkeypatch.setattr(kernel_module, "INTERPRET", False)
    monkeypatch.setattr(kernel_module, "multiprocessors", lambda index: 132)
    cpu = torch.device("cpu")
    assert kernel_module.decode_splits(1, 4, 2048, cpu) == 32  # 2048 / 64 positions bound it
    assert kernel_module.decode_splits(1, 4, 8192, cpu) == 66  # 2 x 132 / 4 programs bound it
    assert kernel_module.decode_splits(64, 4, 2048, cpu) == 2
    assert kernel_module.decode_splits(256, 4, 2048, cpu) == 1
    assert kernel_module.decode_splits(1, 4, 100, cpu) == 2
