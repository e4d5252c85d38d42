"""The exact numerics mode on a tiny model under the interpreter: a token's logits, routed experts and log-softmax
statistics are the same bits in the trainer's forward over the packed sequences and in the rollout engine's paged
forward, whether the engine prefilled the sequence in one packed forward with another prompt, or prefilled it in
part and then decoded it token by token, alone or in a batch with another row that joins, changes places and
leaves."""
import copy
import dataclasses

import pytest
import torch

from moe_rl_eks.kernels._triton import INTERPRET
from moe_rl_eks.kernels.logprobs import softmax_stats
from moe_rl_eks.kernels.prefill_attention import prefill_tiles
from moe_rl_eks.tools.bench.rollout import TINY
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.backends import get_forward_kernels
from moe_rl_eks.workloads.model.logprobs import inverse_temperatures
from moe_rl_eks.workloads.model.paged_forward import PackedAttention, sequence_hidden
from moe_rl_eks.workloads.rollout.kv_cache_manager import PagedCache
from moe_rl_eks.workloads.rollout.model_runner import ModelRunner

DEVICE = "cpu" if INTERPRET else "cuda"  # compiled on a GPU with --noconftest


# a shared expert (DeepSeek's, every token through it beside its routed ones): one layer, to keep the test short
SHARED = dataclasses.replace(TINY, num_hidden_layers=1, n_shared_experts=1)


# bf16 through the interpreter takes about twice fp32's 20 s here: compiled only (tools/gpu_runs/h200-exact.sh); the
# kernel tests cover bf16 rows under the interpreter
@pytest.mark.parametrize("dtype, config", [
    pytest.param(torch.float32, TINY, id="float32"),
    pytest.param(torch.bfloat16, TINY, id="bfloat16", marks=pytest.mark.skipif(
        INTERPRET, reason="bf16 end to end runs compiled (tools/gpu_runs/h200-exact.sh)")),
    pytest.param(torch.bfloat16, SHARED, id="bfloat16-shared-expert", marks=pytest.mark.skipif(
        INTERPRET, reason="bf16 end to end runs compiled (tools/gpu_runs/h200-exact.sh)")),
    pytest.param(torch.float32, SHARED, id="float32-shared-expert")])
def test_the_trainers_exact_forward_and_the_engines_prefill_and_decode_give_a_token_the_same_bits(dtype, config):
    torch.manual_seed(0)
    model = MoETransformer(config, compute="exact").eval().to(DEVICE, dtype)
    a, b = torch.randint(0, config.vocab_size, (9,)).tolist(), torch.randint(0, config.vocab_size, (5,)).tolist()
    empty = PagedCache.allocate(config, 2, 12, 8, 4, DEVICE, dtype)
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
        # the trainer's forward over the same two sequences packed back to back
        kernels = get_forward_kernels("exact")
        hidden, trainer_routing, _ = sequence_hidden(model, PackedAttention(model), kernels, tensor(a + b), [9, 5])
        trainer = kernels.linear(hidden, model.lm_head.weight)
        assert torch.equal(trainer, reference)
        engine_routing = torch.cat([whole.cache.routing_of(0, 9), whole.cache.routing_of(1, 5)])
        assert torch.equal(trainer_routing, engine_routing.long())
        want = {("a", p): trainer[p] for p in range(9)} | {("b", p): trainer[9 + p] for p in range(5)}
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
        assert torch.equal(logits, want[key]), f"{key}: the engine's logits differ from the trainer's"
    # log p of a token at temperature 0.7: the engine's rows one at a time, the trainer's all at once
    keys = sorted(got)
    targets = torch.randint(0, config.vocab_size, (len(keys),)).to(DEVICE)
    engine = torch.cat([torch.stack(softmax_stats(got[key][None], targets[i:i + 1], inverse_temperatures(0.7, 1, DEVICE)))
                        for i, key in enumerate(keys)], 1)
    trainer = softmax_stats(torch.stack([want[k] for k in keys]), targets, inverse_temperatures(0.7, len(keys), DEVICE))
    assert torch.equal(engine, torch.stack(trainer))
