"""Where a rollout engine's step time goes: the device's forwards and sampling apart from the host's work between
them (ModelRunner's DeviceClock, the engine's counters), and that a weight swap keeps the decoder (its KV cache and
CUDA graphs are built once per server, not per version)."""
import time

import pytest
from rl_helpers import publish_initial, tiny_run

from moe_rl_eks.core import metrics as M
from moe_rl_eks.tools.bench import engine_host
from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer
from moe_rl_eks.workloads.rl.weights import DirectoryStore
from moe_rl_eks.workloads.rollout.engine import RolloutEngine, RowRequest, SamplingParams
from moe_rl_eks.workloads.rollout.model_runner import DeviceClock


def test_the_device_clock_counts_its_windows_and_not_the_time_between_them():
    import torch

    clock = DeviceClock(torch.device("cpu"))
    clock.start()
    time.sleep(0.05)
    clock.stop()
    time.sleep(0.05)  # host time: not counted
    clock.start()
    time.sleep(0.02)
    clock.stop()
    clock.stop()  # a stop without a start adds nothing
    assert 0.07 <= clock.take() < 0.095
    assert clock.take() == 0.0  # taken once


@pytest.fixture
def served(tmp_path):
    run = tiny_run(tmp_path, rollout={"max_batch_size": 4, "max_new_tokens": 40},
                   sampling={"max_n": 4, "max_prompt_tokens": 16}, algorithm={"group_size": 4})
    store = DirectoryStore(tmp_path / "weights")
    publish_initial(run, store)
    engine = RolloutEngine(run, store, tmp_path / "cache", CharTokenizer())
    engine.load_version(0)
    yield run, store, engine
    engine.stop()


def counter(engine, metric) -> float:
    return engine.metrics.registry.get_sample_value(metric.name) or 0.0


def test_each_step_is_counted_and_its_device_time_is_within_its_busy_time(served):
    _, _, engine = served
    steps, seen = [], []
    report = engine._report_ranks

    def reported(reports):  # the counters as a reader sees them once a step has delivered its rows
        report(reports)
        seen.append((counter(engine, M.ROLLOUT_DEVICE_SECONDS), counter(engine, M.ROLLOUT_BUSY_SECONDS)))

    engine._report_ranks = reported
    rows = [RowRequest((1, 6, 13, 7, 16), SamplingParams(12, seed=3, stop_token_ids=()), "a", 0)]
    out = engine.submit(rows, lambda events: steps.append(len(events))).result(timeout=60)
    assert len(out[0].token_ids) == 12
    # one row samples in every step (two tokens in its first: the prompt's last prefill chunk, then a decode)
    assert counter(engine, M.ROLLOUT_STEPS) == len(steps) == 11
    device, busy = counter(engine, M.ROLLOUT_DEVICE_SECONDS), counter(engine, M.ROLLOUT_BUSY_SECONDS)
    assert 0 < device < busy
    # never more device time than busy time, even between a step's delivery and its counting (a bench that read
    # the counters there saw it: the device's seconds were counted inside the step, its busy time after)
    assert len(seen) >= 11 and all(d <= b for d, b in seen), seen


def test_a_weight_swap_keeps_the_decoder_and_so_its_cuda_graphs(served, tmp_path):
    run, store, engine = served
    rows = [RowRequest((1, 6, 13, 7, 16), SamplingParams(4, seed=3, temperature=0.0), "a", 0)]
    engine.submit(rows).result(timeout=60)
    decoder = engine.replica.decoder
    publish_initial(run, store, version=1, seed=1)
    engine.load_version(1)
    out = engine.submit([RowRequest(r.prompt_ids, r.params, "b", 0) for r in rows]).result(timeout=60)
    assert out[0].weight_version == 1
    assert engine.replica.decoder is decoder


def test_bench_engine_host_splits_every_step_into_device_and_host_time(tmp_path):
    out = engine_host.measure(rows=32, slots=16, n=16, prompt_tokens=8, new_tokens=8, work=tmp_path)
    assert out["tokens"] == 32 * 8
    # two waves of 16 rows: 7 steps each (8 tokens, two in the first step)
    assert out["steps"] == 14
    assert out["device_ms_per_step"] > 0 and out["host_ms_per_step"] > 0
    assert out["device_ms_per_step"] + out["host_ms_per_step"] == pytest.approx(out["busy_ms_per_step"])
