"""`moerl bench-rl --gpu` at a tiny size on the CPU: the same code path as on the H200 (real rollout server,
orchestrator and trainer processes, the standalone child), its breakdown, the memory fit and the targets."""
import json
import time
from datetime import datetime

import pytest

from moe_rl_eks.core.rl_config import TaskConfig
from moe_rl_eks.tools.bench.rl_gpu import (fitting_layers, generating_spans, main, parse_args, phase_split, summarize,
                                           targets, training_spans)
from moe_rl_eks.workloads.rl.data import RandomTokenSource

# the real RL loop's processes on a 2-core machine: never beside another such run (make test's workers)
pytestmark = pytest.mark.xdist_group("rl_loop")

TINY = ["--tiny", "--steps", "2", "--samples", "8", "--n", "4", "--prompt-tokens", "8", "--mean-tokens", "6",
        "--max-tokens", "16", "--batch-size", "8", "--microbatch-tokens", "256"]


def test_the_tiny_benchmark_runs_the_real_loop_with_drawn_lengths_and_its_parts_are_measured_and_add_up(tmp_path,
                                                                                                        capsys):
    assert main([*TINY, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "sync" / "results.json").read_text())
    steps = result["steps"]
    assert [s["step"] for s in steps] == [1, 2] and all(s["samples"] == 8 for s in steps)
    # EOS ignored, lengths drawn: every group's rows ran to exactly their prompt's drawn max_tokens (the source
    # of the run's seed 0, in draw order), so the trained completion tokens are known in advance
    source = RandomTokenSource(TaskConfig(name="random_tokens", prompt_tokens=8, mean_completion_tokens=6), 0, 512, 16)
    drawn = [source.next().max_tokens for _ in range(4)]  # 2 groups per step, 2 steps
    assert [s["trained_tokens"] - 8 * 8 for s in steps] == [4 * sum(drawn[:2]), 4 * sum(drawn[2:])]
    for s in steps:
        parts = [s["idle_s"], s["score_s"], s["train_s"], s["publish_s"]]
        assert all(p >= 0 for p in parts) and s["train_s"] > 0 and s["generation_s"] >= 0
        assert sum(parts) + s["other_s"] == pytest.approx(s["step_s"])  # the rest is what the parts leave
        assert s["other_s"] >= -1e-6  # the measured parts never exceed the step
    # the rollout's counters are read as each step's record appears: at this size the next batch's generation
    # can start before the record is written, so a step's window need not hold its own generation; all of them do
    assert sum(s["generation_s"] for s in steps) > 0
    # of the generating time, the device's forwards and the engine's host work between them, over its steps
    assert sum(s["engine_steps"] for s in steps) > 0 and sum(s["rollout_device_s"] for s in steps) > 0
    for s in steps:
        assert s["rollout_device_s"] + s["rollout_host_s"] == pytest.approx(s["generation_s"])
    # every NVML sample of the window in one phase (none on a machine without nvidia-smi)
    phases = result["nvml_phases"].values()
    assert sum(p["samples"] for p in phases) == result["nvml_samples"] == len(result["nvml_trace"])
    assert sum(s["generated_tokens"] for s in steps) >= sum(s["trained_tokens"] - 64 for s in steps)
    alone, summary = result["standalone"], result["summary"]
    # alone: the first measured step's (the second's) requests at their drawn lengths
    assert alone["generation"]["complete"] and alone["generation"]["generated"] == 4 * sum(drawn[2:])
    assert alone["trainer_tokens_per_s"] > 0 and summary["sync_over_standalone"] > 0
    assert summary["steps_measured"] == [2] and result["layers"] == 2
    # sync: version 1 was on the server before step 2's batch could be generated (read then or at a newer one)
    assert result["placement"] == "colocated" and [d["version"] for d in result["deliveries"]] == [1, 2]
    assert result["deliveries"][0]["delivery_s"] >= 0
    out = capsys.readouterr().out
    assert "target sync step <= 1.15 x its parts alone" in out and "target GPU busy >= 90%" in out
    assert "placement colocated on the CPU; weights published -> served: v1 " in out


def test_a_gpu_too_small_for_the_layers_takes_the_largest_count_that_fits_and_says_why(tmp_path):
    args = parse_args([])
    assert fitting_layers(args, tmp_path, [143_771 * 2**20]) == (8, None)  # an H200: 8 layers of the 30B shape fit
    layers, why = fitting_layers(args, tmp_path, [80 * 2**30])
    assert layers == 4
    assert "local_gpus.trainer.memory_share: 0.76" in why and "the trainer needs 101.5 GiB" in why  # + activations


def step(n, step_s, train_s, tokens=1000.0, generated=900.0, generation_s=5.0):
    return {"step": n, "step_s": step_s, "idle_s": step_s - train_s - 1, "score_s": 0.0, "train_s": train_s,
            "publish_s": 0.5, "other_s": 0.5, "generation_s": generation_s, "load_s": 2.0, "trained_tokens": tokens,
            "generated_tokens": generated, "samples": 10, "staleness": 0.0, "rollout_device_s": 0.8 * generation_s,
            "rollout_host_s": 0.2 * generation_s, "engine_steps": 500}


def test_targets_compare_a_sync_step_with_its_parts_alone_and_async_with_sync():
    steps = [step(1, 60.0, 5.0), step(2, 20.0, 4.0), step(3, 22.0, 4.0)]
    alone = {"generation_s": 10.0, "trainer_tokens_per_s": 500.0}  # 10 + 1000 / 500 + 0.5 + 2 = 14.5 s alone
    s = summarize(steps, 8, alone, 0.95)
    assert s["steps_measured"] == [2, 3] and s["step_s_median"] == 21.0
    assert s["samples_per_s"] == pytest.approx(20 / 42) and s["loop_tokens_per_s_per_gpu"] == pytest.approx(2000 / 42)
    assert s["loop_tokens_per_s_48_layer_equivalent"] == pytest.approx(2000 / 42 * 8 / 48)
    assert s["trainer_tokens_per_s"] == 250.0 and s["rollout_tokens_per_s"] == 180.0
    assert s["sync_over_standalone"] == pytest.approx(20 / 14.5)  # the first measured step's, like for like
    # the engine's host work: 1 s of each measured step's 5 s of generation, over its 500 engine steps
    assert s["rollout_host_share"] == pytest.approx(0.2) and s["rollout_host_ms_per_engine_step"] == pytest.approx(2.0)
    assert targets("sync", s, None) == [("sync step <= 1.15 x its parts alone", pytest.approx(20 / 14.5), False),
                                        ("GPU busy >= 90% of 100 ms samples", 0.95, True)]
    fast = summarize([step(1, 60.0, 5.0), step(2, 15.0, 4.0)], 8, None, None)
    assert targets("async", fast, s)[0] == ("async samples/s >= 1.1 x sync", pytest.approx((10 / 15) / (20 / 42)), True)
    assert targets("async", fast, None)[0][2] is None and targets("async", fast, None)[1] == (
        "GPU busy >= 90% of 100 ms samples", None, None)


def test_gpu_busy_is_the_share_of_stamped_samples_at_90_percent_or_more_within_the_window(tmp_path, monkeypatch):
    from moe_rl_eks.tools.bench.rl_gpu import GpuSampler

    # nvidia-smi's own lines (timestamp, utilisation), 100 ms apart; stamps, not arrival, place them in the window
    lines = [f"2026/12/02 00:00:0{i // 10}.{i % 10}00, {u}" for i, u in enumerate([0, 95, 90, 89, 100, 99, 30, 91])]
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(f"'{x}'" for x in [*lines, "2026/12/02 00:00:00.900, [N/A]"])
                    + "\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    sampler = GpuSampler()
    sampler.proc.wait(timeout=10)
    sampler.stop()
    for _ in range(100):  # the reading thread takes the last lines after the process ends
        if len(sampler.samples) == 8:
            break
        time.sleep(0.01)
    at = datetime(2026, 12, 2).timestamp()
    assert sampler.busy(at + 0.1, at + 0.7) == (5 / 7, 7)  # 95, 90, 100, 99, 91 of 95 90 89 100 99 30 91
    assert sampler.busy(at + 5, at + 6) == (None, 0)


def test_nvml_samples_split_by_what_ran_each_with_its_busy_share_and_mean_utilisation():
    # the rollout's busy counter read every 0.5 s: generating in [0, 1] (0.5 s of 0.5 s, then 0.3 of 0.5), idle in
    # [1, 1.5] (0.1 of 0.5), generating again in [1.5, 2]
    generating = generating_spans([(0.0, 0.0), (0.5, 0.5), (1.0, 0.8), (1.5, 0.9), (2.0, 1.4)])
    assert generating == [(0.0, 0.5), (0.5, 1.0), (1.5, 2.0)]
    # a trainer row written at 3.0 after 2.2 s: 2.0 s of compute, then 0.2 s of publication
    training = training_spans([{"time": 3.0, "step_seconds": 2.2, "step_compute_seconds": 2.0}])
    assert training == [(pytest.approx(0.8), pytest.approx(2.8))]
    samples = [(0.2, 95), (0.6, 80), (0.9, 100), (1.2, 92), (1.6, 60), (2.5, 100), (2.9, 0), (3.5, 10)]
    split = phase_split(samples, generating, training)
    assert split["generation"] == {"samples": 2, "busy": 0.5, "mean_utilisation": pytest.approx(0.875),
                                   "share": 0.25}  # 95, 80
    assert split["both"] == {"samples": 2, "busy": 0.5, "mean_utilisation": pytest.approx(0.8),
                             "share": 0.25}  # 100 at 0.9, 60 at 1.6
    assert split["training"] == {"samples": 2, "busy": 1.0, "mean_utilisation": pytest.approx(0.96),
                                 "share": 0.25}  # 92 at 1.2, 100 at 2.5
    assert split["neither"] == {"samples": 2, "busy": 0.0, "mean_utilisation": pytest.approx(0.05), "share": 0.25}
    assert phase_split([], generating, training)["neither"] == {"samples": 0, "busy": None, "mean_utilisation": None,
                                                                "share": None}


H200 = 143_771 * 2**20


def test_split_placement_puts_the_trainer_on_gpu_0_and_the_server_on_gpu_1_each_with_its_gpu_and_weights_via_store(
        tmp_path):
    from moe_rl_eks.core.run import RunConfig
    from moe_rl_eks.core.schema import parse
    from moe_rl_eks.tools.bench.rl_gpu import run_data

    def run(*argv):
        return parse(RunConfig, run_data(parse_args(list(argv)), 8, tmp_path), source="test")

    split, colocated = run("--placement", "split"), run()
    assert (split.local_gpus.trainer.gpus, split.local_gpus.rollout.gpus) == ((0,), (1,))
    assert (split.local_gpus.trainer.memory_share, split.local_gpus.rollout.memory_share) == (0.9, 0.9)
    assert not split.weights_over_device and colocated.weights_over_device  # versions go through the store
    assert (colocated.local_gpus.trainer.gpus, colocated.local_gpus.rollout.gpus) == ((0,), (0,))
    assert (colocated.local_gpus.trainer.memory_share, colocated.local_gpus.rollout.memory_share) == (0.76, 0.22)
    # without the export to a colocated server the trainer's 0.9 of an H200 holds the 8 layers too
    assert fitting_layers(parse_args(["--placement", "split"]), tmp_path, [H200, H200]) == (8, None)
    assert run("--placement", "split", "--trainer-share", "1.0").local_gpus.trainer.memory_share == 1.0


def test_split_placement_is_refused_on_a_machine_with_one_gpu_naming_the_field_and_the_count(tmp_path, monkeypatch):
    from moe_rl_eks.tools.bench import rl_gpu

    monkeypatch.setattr(rl_gpu, "gpu_memory_bytes", lambda: [H200])
    with pytest.raises(SystemExit) as err:
        main(["--placement", "split", "--out", str(tmp_path)])
    text = str(err.value)
    assert "local_gpus.rollout.gpus: [1]" in text and "GPU 1 is not on this machine, which has 1" in text
    assert "nvidia-h200-x2" in text
    assert not (tmp_path / "sync" / "run").exists()  # nothing started
    with pytest.raises(SystemExit):  # --tiny is the CPU: there is nothing to split
        parse_args(["--tiny", "--placement", "split"])


def test_each_version_is_timed_from_its_publication_to_the_server_serving_it_beside_the_trainer_step():
    from moe_rl_eks.core.metrics import WEIGHT_PUBLISH_SECONDS
    from moe_rl_eks.tools.bench.rl_gpu import deliveries

    PUBLISH = WEIGHT_PUBLISH_SECONDS.name
    rows = [{"version": 1, "time": 100.0, PUBLISH: 2.0, "step_compute_seconds": 20.0},
            {"version": 2, "time": 130.0, PUBLISH: 2.0, "step_compute_seconds": 20.0},
            {"version": 3, "time": 160.0, PUBLISH: 2.0, "step_compute_seconds": 20.0},
            {"version": 4, "time": 190.0, PUBLISH: 2.0, "step_compute_seconds": 20.0}]
    # version 2 served between two readings (or skipped): there by the reading that shows version 3; version 4
    # not there before the run stopped
    got = deliveries(rows, {0: 50.0, 1: 103.0, 3: 158.0})
    assert got == [{"version": 1, "delivery_s": 5.0, "trainer_step_s": 20.0},
                   {"version": 2, "delivery_s": 30.0, "trainer_step_s": 20.0},
                   {"version": 3, "delivery_s": 0.0, "trainer_step_s": 20.0},
                   {"version": 4, "delivery_s": None, "trainer_step_s": 20.0}]
    steps = [step(1, 60.0, 5.0), step(2, 20.0, 4.0)]
    alone = {"generation_s": 10.0, "trainer_tokens_per_s": 500.0}  # 10 samples: 1 /s rolled out, 5 /s trained
    s = summarize(steps, 8, alone, None, got)
    assert s["parts_alone_samples_per_s"] == 1.0 and s["delivery_s_max"] == 30.0
    assert s["delivery_over_trainer_step_max"] == 1.5  # version 2 took 1.5 trainer steps
    assert targets("sync", s, None, "split") == [("every version on the server within the trainer's step time",
                                                  1.5, False)]
    # async split: 0.5 samples/s against the slower part's 1 /s alone, read from the sync run's summary
    fast = summarize([step(1, 60.0, 5.0), step(2, 20.0, 4.0)], 8, None, None, got[:1])
    assert targets("async", fast, s, "split") == [
        ("async samples/s >= 0.85 x min(rollout alone, trainer alone)", 0.5, False),
        ("every version on the server within the trainer's step time", 0.25, True)]
    assert targets("async", fast, None, "split")[0][1:] == (None, None)
