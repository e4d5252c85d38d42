"""Batched sampling: a group's rows share one prefill of their prompt and still sample as if each ran alone."""
import pytest
import torch
from rl_helpers import tiny_run

from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.rl.generation import Row, generate

EOS = 2


def test_rows_sharing_a_prompt_are_prefilled_once_and_sample_as_they_would_alone(tmp_path):
    run = tiny_run(tmp_path)
    torch.manual_seed(0)
    model = MoETransformer(run.model).eval()
    group = [Row([1, 6, 13, 7, 16], 6, 1.0, 1.0, seed, want_routing=True) for seed in range(4)]
    other = [Row([1, 9, 13, 9, 16, 4], 4, 0.7, 0.9, 11)]
    prefill_rows = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: prefill_rows.append(args[0].shape),
                                           with_kwargs=True)
    together = generate(model, group + other, EOS)
    hook.remove()
    assert prefill_rows[0] == (2, 6)  # two distinct prompts, the longer 6 tokens
    assert all(shape[0] == 5 for shape in prefill_rows[1:])  # then every row decodes
    for row, got in zip(group + other, together):
        (alone,) = generate(model, [row], EOS)
        assert got.tokens == alone.tokens and got.routing == alone.routing
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert len({tuple(r.tokens) for r in together[:4]}) > 1  # the group's seeds still give different samples


def test_the_generation_benchmark_prints_its_table(capsys):
    from moe_rl_eks.workloads.rl.bench_generation import main

    assert main(["--group", "2", "--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["2 distinct", "1 shared"]
