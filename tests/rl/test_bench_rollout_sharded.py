"""`moerl bench-rollout --gpus-per-server N`: the rollout server's engine sharded over N ranks as serve-rollout
runs it (gloo here; NCCL one rank per GPU on a GPU machine: tools/gpu_runs/ep.sh)."""
import json

from moe_rl_eks.tools.bench.rollout import main


def test_the_engine_sharded_over_two_ranks_generates_every_row_and_one_rank_is_the_baseline(tmp_path, capsys):
    out = tmp_path / "sharded.json"
    assert main(["--tiny", "--gpus-per-server", "1", "2", "3", "--batches", "3", "5", "--prompt-tokens", "8",
                 "--new-tokens", "4", "--json", str(out)]) == 0
    one, two, three = json.loads(out.read_text())["sharded"]
    assert (one["gpus_per_server"], two["gpus_per_server"]) == (1, 2)
    for entry in (one, two):
        assert [r["batch"] for r in entry["rows"]] == [3, 5]
        for r in entry["rows"]:
            assert 0 < r["generated"] <= r["batch"] * 4 and r["errors"] == []
    assert three == {"gpus_per_server": 3, "skipped": "3 ranks do not divide 8 experts"}
    assert "   3 not run: 3 ranks do not divide 8 experts" in capsys.readouterr().out
