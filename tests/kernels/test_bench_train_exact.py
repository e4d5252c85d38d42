"""`moerl bench-train --exact`: each row's step measured again as a batch's first optimizer step under numerics:
exact (the exact scorer's differentiable forward on the batch-invariant kernels and its backward), and the
scoring forward standard and exact, reported in the same table beside the standard step. On a tiny model through Triton's interpreter (the H200 run:
tools/gpu_runs/h200-exact.sh); no timing is asserted, only that both columns are measured and reported."""
import json

import pytest

from moe_rl_eks.tools.bench.train import main


def test_the_exact_column_measures_the_first_step_and_the_scoring_both_ways_beside_the_standard_step(tmp_path,
                                                                                                       capsys):
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--exact", "--compute", "torch", "--checkpointing", "off", "--shapes", "2x24",
                 "--steps", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    [row] = result["rows"]
    exact = row["exact"]
    assert row["status"] == exact["status"] == "ok"
    assert row["step_seconds"] > 0 and exact["step_seconds"] > 0
    # the same model FLOPs, so MFU falls by exactly the step time's ratio
    assert exact["model_tflop_per_step"] == row["model_tflop_per_step"]
    assert exact["mfu"] == pytest.approx(row["mfu"] * row["step_seconds"] / exact["step_seconds"])
    assert "exact_scorer_gib" in result
    table = capsys.readouterr().out
    assert "| exact step s | exact MFU | exact peak above GiB | exact / standard | score s standard / exact |" in table
    ratio = exact["step_seconds"] / row["step_seconds"]
    assert exact["standard_score_seconds"] > 0 and exact["exact_score_seconds"] > 0
    assert (f"| {exact['step_seconds']:.2f} | {100 * exact['mfu']:.1f} % | - | {ratio:.2f}x | "
            f"{exact['standard_score_seconds']:.3f} / {exact['exact_score_seconds']:.3f} |") in table


@pytest.mark.parametrize("argv, unset, message", [
    (["--tiny", "--exact", "--ranks", "2", "--ep-backend", "deepep"], False,
     "--exact with --ep-backend deepep: a run refuses numerics: exact with DeepEP"),
    (["--tiny", "--exact"], True, "--exact --tiny runs the exact kernels on the CPU through Triton's interpreter: "
                                  "set TRITON_INTERPRET=1"),
])
def test_an_exact_column_that_cannot_run_is_refused_saying_why(argv, unset, message, capsys, monkeypatch):
    if unset:
        monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
