"""Batched sampling: a group's rows share one prefill of their prompt and still sample as if each ran alone."""
import pytest
import torch
from rl_helpers import tiny_run

from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.rl.generation import Row, generate

EOS = 2
# The rollout engine decodes on its GPU; the CUDA cases run on the H200 through the device tool.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_rows_share_a_prefill_finished_rows_leave_the_batch_and_each_samples_as_it_would_alone(tmp_path, device):
    run = tiny_run(tmp_path)
    torch.manual_seed(0)
    model = MoETransformer(run.model).eval().to(device)
    # one prompt's group with uneven lengths (rows stop early as at end-of-sequence), and another prompt
    group = [Row([1, 6, 13, 7, 16], n, 1.0, 1.0, seed, want_routing=True) for seed, n in enumerate([6, 1, 1, 2])]
    other = [Row([1, 9, 13, 9, 16, 4], 4, 0.7, 0.9, 11, want_routing=True)]
    batches = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: batches.append(args[0].shape),
                                           with_kwargs=True)
    together = generate(model, group + other, EOS)
    hook.remove()
    assert batches[0] == (2, 6)  # two distinct prompts prefilled, the longer 6 tokens
    decode = [shape[0] for shape in batches[1:]]
    assert decode[0] == 5 and decode == sorted(decode, reverse=True) and decode[-1] < 5, decode  # rows left
    for row, got in zip(group + other, together):
        (alone,) = generate(model, [row], EOS)
        assert got.tokens == alone.tokens and got.routing == alone.routing
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert len({tuple(r.tokens[:1]) for r in together[:4]}) > 1  # the group's seeds still give different samples


def test_the_generation_benchmark_prints_its_table(capsys):
    from moe_rl_eks.workloads.rl.bench_generation import main

    assert main(["--group", "2", "--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["2 distinct", "1 shared"]


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_follows_the_scaled_distribution_cut_to_top_p_and_reports_the_uncut_logprob(device):
    from moe_rl_eks.workloads.rl.generation import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], device=device)).repeat(3, 1)
    rows = [Row([1], 1, 1.0, 1.0, None), Row([1], 1, 1.0, 0.7, None), Row([1], 1, 0.0, 1.0, None)]
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    counts = torch.zeros(3, 4)
    for _ in range(4000):
        tokens, logprobs = sample(logits, rows, gens)
        for row, token in enumerate(tokens):
            counts[row, token] += 1
        assert logprobs == pytest.approx([float(logits[0, t]) for t in tokens], abs=1e-6)  # temperature 1: log p
    freq = counts / counts.sum(1, keepdim=True)
    assert freq[0].tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.03)
    assert freq[1].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=0.03)  # top-p 0.7 keeps 0.5 + 0.3
    assert freq[2].tolist() == [1.0, 0.0, 0.0, 0.0]  # greedy
    hot, _ = sample(logits[:1] * 0 + torch.tensor([[0.0, 1.0, 0.0, 0.0]], device=device), [Row([1], 1, 0.25, 1.0, 0)],
                    [torch.Generator().manual_seed(0)])
    assert hot == [1]  # a low temperature sharpens towards the largest logit
