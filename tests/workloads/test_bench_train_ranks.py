"""`moerl bench-train --ranks N`: the trainer's step under expert parallelism, one process per rank (gloo on this
CPU; NCCL one rank per GPU on a GPU machine: tools/gpu_runs/ep.sh), and one publication through the
Publisher with each rank writing its experts."""
import json

import pytest

from moe_rl_eks.tools.bench.train import TINY, main
from moe_rl_eks.workloads.model.checkpoint import load_hf


def test_two_ranks_train_every_ranks_tokens_and_publish_a_complete_version(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--ranks", "2", "--compute", "torch", "--checkpointing", "full", "--shapes", "2x32",
                 "--steps", "1", "--publish", str(tmp_path / "store"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["ranks"], result["transport"], result["ep_backend"]) == (2, "gloo", "alltoall")
    [row] = result["rows"]
    assert row["status"] == "ok" and row["tokens"] == 2 * 2 * 32  # both ranks' micro-batches
    assert len(row["rank_step_seconds"]) == 2 and row["step_seconds"] == max(row["rank_step_seconds"])
    assert row["tokens_per_second"] == pytest.approx(row["tokens"] / row["step_seconds"])
    assert "2 EP ranks (alltoall over gloo)" in capsys.readouterr().out
    # Each rank wrote its own experts; rank 0 committed one version holding all of them.
    published = result["publish"]["torch"]
    assert published["version"] == [0, 1] and published["files"] == 2
    [version_dir] = (tmp_path / "store" / "torch").glob("l*-v*")
    config, state = load_hf(version_dir)
    assert config.num_experts == TINY.num_experts
    assert state["model.layers.0.mlp.experts.down_proj"].shape[0] == TINY.num_experts


@pytest.mark.parametrize("argv, message", [
    (["--tiny", "--publish", "x"], "--publish measures expert-parallel publication: it needs --ranks >= 2"),
    (["--tiny", "--ranks", "0"], "--ranks must be >= 1, got 0"),
    (["--tiny", "--microbatches", "0"], "--microbatches must be >= 1, got 0"),
])
def test_bad_rank_options_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_ranks_that_do_not_divide_the_experts_are_refused(capsys):
    assert main(["--tiny", "--ranks", "3"]) == 2
    assert "--ranks 3 must divide the model's 8 experts" in capsys.readouterr().err


def test_one_ranks_ep_share_trains_its_local_experts_and_prints_the_planners_memory(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--ep-share", "4", "--compute", "torch", "--checkpointing", "full", "--shapes", "2x32",
                 "--steps", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["num_experts"] == TINY.num_experts // 4
    assert result["config"]["num_experts_per_tok"] == TINY.num_experts_per_tok
    [row] = result["rows"]
    assert row["status"] == "ok" and row["ep_share"] == 4 and row["planned_peak_above_gib"] > 0
    assert "planned GiB" in capsys.readouterr().out


def test_an_ep_share_that_leaves_fewer_local_experts_than_top_k_is_refused(capsys):
    assert main(["--tiny", "--ep-share", "8"]) == 2  # 8 experts / 8 = 1 < top-2
    assert "--ep-share 8 must divide the model's 8 experts into shares of at least top-k (2)" in capsys.readouterr().err


def test_a_step_of_two_copies_of_a_micro_batch_accumulates_to_the_one_micro_batch_steps_weights_bitwise():
    """--microbatches N: the trainer's step over N micro-batches, the loss normalised over all their tokens, so two
    copies of one micro-batch give each gradient bitwise half of one's (a power of two) and the same weights."""
    import torch

    from moe_rl_eks.tools.bench.train import Step

    def trained(microbatches: int) -> tuple[dict, dict]:
        torch.manual_seed(0)
        step = Step(TINY, "torch", torch.device("cpu"))
        before = {k: v.clone() for k, v in step.model.state_dict().items()}
        step.run(step.batch(32, 2, torch.Generator().manual_seed(1)), microbatches=microbatches)
        return before, step.model.state_dict()

    (start, one), (start_two, two) = trained(1), trained(2)
    assert all(torch.equal(start[k], start_two[k]) for k in start)
    assert sum(not torch.equal(start[k], one[k]) for k in one) > len(one) // 2  # the step moved the weights
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_the_microbatches_of_a_row_count_in_its_tokens_and_flops(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--microbatches", "3", "--compute", "torch", "--checkpointing", "full", "--shapes", "2x32",
                 "--steps", "1", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert (row["microbatches"], row["tokens"]) == (3, 3 * 2 * 32)
    assert row["model_tflop_per_step"] == pytest.approx(3 * main_flops(2, 32))


def main_flops(sequences: int, sequence: int) -> float:
    from moe_rl_eks.tools.bench.train import model_flops_per_step
    return model_flops_per_step(TINY, sequence, sequences) / 1e12
