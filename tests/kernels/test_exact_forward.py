"""The rollout engine's paged forward on the `exact` backend: a token's logits are the same bits whether its
sequence was prefilled in one packed forward with another prompt, or prefilled in part and then decoded token by
token, alone or in a batch with another row that joins, changes places and leaves."""
import copy
import dataclasses

import torch

from moe_rl_eks.kernels._triton import INTERPRET
from moe_rl_eks.kernels.prefill_attention import prefill_tiles
from moe_rl_eks.tools.bench.rollout import TINY
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.rollout.kv_cache_manager import PagedCache
from moe_rl_eks.workloads.rollout.model_runner import ModelRunner

DEVICE = "cpu" if INTERPRET else "cuda"  # compiled on a GPU with --noconftest


def test_a_tokens_logits_are_the_same_bits_prefilled_or_decoded_in_any_batch():
    torch.manual_seed(0)
    model = MoETransformer(TINY, compute="exact").eval().to(DEVICE)
    a, b = torch.randint(0, TINY.vocab_size, (9,)).tolist(), torch.randint(0, TINY.vocab_size, (5,)).tolist()
    empty = PagedCache.allocate(TINY, 2, 12, 8, 4, DEVICE, torch.float32)
    for slot in (0, 1):
        empty.grow(slot, 12)

    def run(cache):
        return ModelRunner(model, cache, cuda_graphs=False, kernels="exact")

    def tensor(values):
        return torch.tensor(values, device=DEVICE)

    with torch.no_grad():
        # both prompts in one packed prefill, every position's logits: the reference
        whole = run(copy.deepcopy(empty))
        whole.cache.sync_tables()
        reference = whole.forward(tensor([0] * 9 + [1] * 5), tensor(a + b), tensor(list(range(9)) + list(range(5))),
                                  tensor(list(range(14))), 9, prefill_tiles([(0, 9), (9, 5)], DEVICE))
        want = {("a", p): reference[p] for p in range(9)} | {("b", p): reference[9 + p] for p in range(5)}
        got = {}
        step = run(copy.deepcopy(empty))
        step.cache.sync_tables()

        def prefill(name, slot, tokens, first):
            n = len(tokens)
            logits = step.forward(tensor([slot] * n), tensor(tokens), tensor(list(range(first, first + n))),
                                  tensor([n - 1]), first + n, prefill_tiles([(0, n)], DEVICE))
            got[(name, first + n - 1)] = logits[0]

        def decode(rows):  # rows: (name, slot, position) fed the sequence's token at that position
            seqs = {"a": a, "b": b}
            logits = step.forward(tensor([s for _, s, _ in rows]), tensor([seqs[n][p] for n, _, p in rows]),
                                  tensor([p for _, _, p in rows]), tensor(list(range(len(rows)))),
                                  max(p for _, _, p in rows) + 1)
            got.update({(n, p): row for (n, _, p), row in zip(rows, logits)})

        prefill("a", 0, a[:3], 0)
        decode([("a", 0, 3)])
        prefill("b", 1, b[:2], 0)
        decode([("a", 0, 4), ("b", 1, 2)])
        decode([("b", 1, 3), ("a", 0, 5)])  # the rows change places
        decode([("a", 0, 6), ("b", 1, 4)])
        decode([("a", 0, 7)])  # b left
        prefill("a", 0, a[8:], 8)  # a one-token chunk of a prefill
    assert set(got) == set(want) - {("a", 0), ("a", 1), ("b", 0)}
    for key, logits in got.items():
        assert torch.equal(logits, want[key]), f"{key}: differs from the packed prefill's logits"
