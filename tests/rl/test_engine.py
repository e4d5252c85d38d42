"""The rollout engine's contract: rows join a running batch and sample as they would alone, cancelled rows leave
it at once, stop tokens, top logprobs, compact routing, validated sampling parameters."""
import threading
import time

import numpy as np
import torch
import pytest
from rl_helpers import publish_initial, tiny_run

from moe_rl_eks.workloads.rollout.engine import RolloutEngine, RowRequest, SamplingParams
from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer
from moe_rl_eks.workloads.rl.weights import DirectoryStore


def engine_of(tmp_path, **rollout):
    """An engine serving version 0 of a tiny run (its rollout section changed by `rollout`)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = tiny_run(tmp_path, rollout={"max_batch_size": 4, "max_new_tokens": 40, **rollout},
                   sampling={"max_n": 4, "max_prompt_tokens": 16}, algorithm={"group_size": 4})
    store = DirectoryStore(tmp_path / "weights")
    publish_initial(run, store)
    engine = RolloutEngine(run, store, tmp_path / "cache", CharTokenizer())
    engine.load_version(0)
    return engine


@pytest.fixture
def engine(tmp_path):
    engine = engine_of(tmp_path)
    yield engine
    engine.stop()


def rows(request_id, n, max_tokens, seed, prompt=(1, 6, 13, 7, 16), **params):
    return [RowRequest(tuple(prompt), SamplingParams(max_tokens, seed=seed, **params), request_id, i)
            for i in range(n)]


def test_a_request_joins_a_running_batch_and_each_row_samples_as_it_would_alone(engine):
    seen = []
    second_started = threading.Event()

    def on_tokens(events):
        for event in events:
            seen.append((event.request_id, event.row, event.token_id))
            if event.request_id == "long" and len(seen) == 3:
                later.append(engine.submit(rows("short", 2, 3, 9, prompt=(1, 4, 13, 5, 16)), on_tokens))
                second_started.set()
    later = []
    first = engine.submit(rows("long", 1, 40, 1, stop_token_ids=()), on_tokens).result(timeout=60)
    second = later[0].result(timeout=60)
    assert second_started.is_set()
    long_tokens = [i for i, s in enumerate(seen) if s[0] == "long"]
    short_tokens = [i for i, s in enumerate(seen) if s[0] == "short"]
    assert long_tokens[0] < short_tokens[0] and short_tokens[-1] < long_tokens[-1]  # joined mid-decode
    alone_first = engine.submit(rows("long", 1, 40, 1)).result(timeout=60)
    alone_second = engine.submit(rows("short", 2, 3, 9, prompt=(1, 4, 13, 5, 16))).result(timeout=60)
    for got, alone in zip(first + second, alone_first + alone_second):
        assert got.token_ids == alone.token_ids and got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert got.finish_reason == alone.finish_reason and got.weight_version == 0
    for o in first + second:  # the streamed tokens are the row's tokens, in order
        assert [t for rid, row, t in seen if (rid, row) == (o.request_id, o.row)] == o.token_ids


def kv_usage(engine) -> float | None:
    return engine.metrics.registry.get_sample_value("moerl_rollout_kv_cache_usage_perc")


def test_a_cancelled_row_leaves_the_batch_and_its_slot_serves_the_next_request(engine):
    started = threading.Event()
    usage = []

    def on_tokens(events):
        usage.append(kv_usage(engine))
        if any(event.row == 0 for event in events):
            started.set()
    future = engine.submit(rows("gone", 4, 40, 3, temperature=0.0, stop_token_ids=()), on_tokens)
    started.wait(timeout=60)
    engine.cancel("gone", rows=[0, 1, 2])
    engine.cancel("gone", rows=[0])  # idempotent
    out = future.result(timeout=60)
    assert [o.finish_reason for o in out[:3]] == ["abort"] * 3 and len(out[0].token_ids) < 40
    assert out[3].finish_reason in ("stop", "length")
    # four slots: a request of four rows runs once the cancelled rows freed theirs
    again = engine.submit(rows("next", 4, 2, 4)).result(timeout=60)
    assert all(o.finish_reason in ("stop", "length") for o in again)
    health = engine.health()
    assert health.running_rows == 0 and health.waiting_rows == 0 and health.version == 0
    assert max(u or 0 for u in usage) > 0  # the metrics gauge followed the blocks the rows held...
    deadline = time.monotonic() + 10
    while kv_usage(engine) != 0 and time.monotonic() < deadline:  # (set after the step that finished them)
        time.sleep(0.01)
    assert kv_usage(engine) == 0  # ... and every block came back


def test_tokens_arrive_once_per_step_per_call_and_the_engine_counts_them_itself(engine):
    bursts = []
    listened = engine.submit(rows("heard", 4, 12, 5, stop_token_ids=()), bursts.append).result(timeout=60)
    quiet = engine.submit(rows("quiet", 2, 12, 6, stop_token_ids=())).result(timeout=60)  # no callback at all
    assert all({e.request_id for e in burst} == {"heard"} for burst in bursts)
    assert len(bursts) <= max(len(o.token_ids) for o in listened)  # a call per step, not per token
    for o in listened:
        assert [e.token_id for b in bursts for e in b if e.row == o.row] == o.token_ids
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in engine.metrics.exposition().decode().splitlines() if line and not line.startswith("#")}
    generated = sum(len(o.token_ids) for o in listened + quiet)
    assert samples["moerl_rollout_generation_tokens_total"] == generated
    assert samples["moerl_rollout_time_to_first_token_seconds_count"] == 6  # one per row
    assert samples["moerl_rollout_inter_token_latency_seconds_count"] == generated - 6


def test_stop_tokens_top_logprobs_and_routing_come_back_compact(engine):
    (greedy,) = engine.submit(rows("g", 1, 6, 0, temperature=0.0)).result(timeout=60)
    stop = greedy.token_ids[1]
    (stopped,) = engine.submit(rows("s", 1, 6, 0, temperature=0.0, stop_token_ids=(stop,), top_logprobs=3,
                                    return_routing=True)).result(timeout=60)
    cut = greedy.token_ids.index(stop) + 1
    assert stopped.token_ids == greedy.token_ids[:cut] and stopped.finish_reason == "stop"  # the stop token is kept
    assert len(stopped.top_logprobs) == cut
    for token, logprob, top in zip(stopped.token_ids, stopped.logprobs, stopped.top_logprobs):
        assert [t for t, _ in top][0] == token and top[0][1] == pytest.approx(logprob)  # greedy: the best one
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    (top_k,) = engine.submit(rows("k", 1, 3, 0, top_k=2, top_logprobs=5)).result(timeout=60)
    assert all(len(top) == 2 for top in top_k.top_logprobs)  # what top-k cut has no finite logprob: left out
    config = engine.run.model
    assert isinstance(stopped.routing, np.ndarray) and stopped.routing.dtype == np.uint8
    assert stopped.routing.shape == (5 + cut - 1, config.num_hidden_layers, config.num_experts_per_tok)
    assert greedy.routing is None


def test_rows_that_cannot_run_fail_alone_and_sampling_params_name_the_bad_field(engine):
    good, = rows("ok", 1, 2, 1)
    too_long = RowRequest(tuple([1] * 60), SamplingParams(2), "long", 0)  # a slot holds 16 + 40 positions
    outside = RowRequest((1, 99), SamplingParams(2), "vocab", 0)
    out = engine.submit([good, too_long, outside]).result(timeout=60)
    assert out[0].finish_reason in ("stop", "length")
    assert out[1].finish_reason == "error" and "60 tokens" in out[1].error
    assert out[2].finish_reason == "error" and "token id 99" in out[2].error
    for field, value, kwargs in [("seed", 2 ** 64, {"seed": 2 ** 64}), ("seed", -1, {"seed": -1}),
                                 ("top_p", 0, {"top_p": 0}), ("top_k", -1, {"top_k": -1}),
                                 ("min_p", 1.5, {"min_p": 1.5}), ("logprob_mode", "x", {"logprob_mode": "x"}),
                                 ("top_logprobs", 21, {"top_logprobs": 21}), ("max_tokens", 0, {"max_tokens": 0})]:
        with pytest.raises(ValueError, match=f"^{field}: {value!r}"):
            SamplingParams(**{"max_tokens": 1, **kwargs})
    assert SamplingParams(1, seed=2 ** 64 - 1).seed == 2 ** 64 - 1


def test_a_failed_step_fails_its_rows_with_the_reason_and_the_engine_keeps_serving(engine, monkeypatch):
    from moe_rl_eks.workloads.rollout.model_runner import ModelRunner

    forward, calls = ModelRunner.forward, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # a decode step of the first request
            raise RuntimeError("CUDA out of memory (simulated)")
        return forward(*args, **kwargs)
    monkeypatch.setattr(ModelRunner, "forward", failing_once)
    out = engine.submit(rows("doomed", 2, 20, 1, stop_token_ids=())).result(timeout=60)
    assert [o.finish_reason for o in out] == ["error", "error"]
    assert "CUDA out of memory (simulated)" in out[0].error and 1 <= len(out[0].token_ids) < 20
    again = engine.submit(rows("after", 2, 3, 1)).result(timeout=60)
    assert all(o.finish_reason in ("stop", "length") for o in again)
    assert engine.health().running_rows == 0


def swap_under_a_running_row(engine, max_tokens=30):
    """Publish version 1 and load it while a row of version 0 (seed 0: it runs all `max_tokens` tokens) decodes
    slowly; returns the row's output once both are done."""
    publish_initial(engine.run, engine.store, version=1, seed=5)
    started = threading.Event()

    def slow_row(event):  # keeps the row running (on the engine thread) while the load below queues its swap
        started.set()
        time.sleep(0.05)

    running = engine.submit(rows("running", 1, max_tokens, 0, stop_token_ids=()), slow_row)
    started.wait(timeout=60)
    swapped = threading.Thread(target=engine.load_version, args=(1,))
    swapped.start()
    (out,) = running.result(timeout=60)
    swapped.join(timeout=60)
    assert not swapped.is_alive() and engine.version == 1
    return out


def served_model(engine, version):
    """A fresh copy of the served model holding `version`, as the replica builds and fills it (on its device)."""
    from moe_rl_eks.workloads.model.checkpoint import load_hf
    from moe_rl_eks.workloads.rollout.replica import empty_model
    from moe_rl_eks.workloads.rollout.weight_staging import install

    config, state = load_hf(engine.store.fetch(version, engine.cache_dir / "reference"))
    model = empty_model(config, None, engine.run.moe_compute, engine.replica.device)
    install(model, state)
    return model.eval(), state


def test_a_drained_swap_waits_for_the_running_row_which_has_one_version(tmp_path):
    engine = engine_of(tmp_path, weight_swap="drain")
    try:
        old = swap_under_a_running_row(engine)
        assert len(old.token_ids) == 30 and old.weight_version == 0  # it ran to its end while the swap waited
        assert [(s.lineage, s.version, s.tokens) for s in old.weight_versions] == [(0, 0, 30)]
        (new,) = engine.submit(rows("after", 1, 30, 0, stop_token_ids=())).result(timeout=60)
        assert new.weight_version == 1
        assert [(s.version, s.tokens) for s in new.weight_versions] == [(1, len(new.token_ids))]
        assert old.token_ids != new.token_ids  # same seed and prompt, other weights
        (alone,) = decode_once(tmp_path / "alone", "drain")  # today's answer: version 0 alone
        assert old.token_ids == alone.token_ids and old.logprobs == pytest.approx(alone.logprobs, abs=1e-6)
        assert engine.metrics.registry.get_sample_value("moerl_rollout_swaps_in_flight_total") == 0
    finally:
        engine.stop()


def decode_once(tmp_path, swap):
    """The swap tests' row on a fresh engine serving version 0 only."""
    engine = engine_of(tmp_path, weight_swap=swap)
    try:
        return engine.submit(rows("running", 1, 30, 0, stop_token_ids=())).result(timeout=60)
    finally:
        engine.stop()


def test_a_row_running_across_an_inflight_swap_finishes_on_the_new_weights_with_the_kv_it_has(engine):
    from moe_rl_eks.workloads.rollout.decoder import Decoder
    from moe_rl_eks.workloads.rollout.weight_staging import install

    assert engine.run.weight_swap == "inflight"  # the default with max_staleness >= 1
    out = swap_under_a_running_row(engine)
    spans = [(s.lineage, s.version, s.tokens) for s in out.weight_versions]
    assert len(spans) == 2 and spans[0][:2] == (0, 0) and spans[1][:2] == (0, 1)
    a, b = spans[0][2], spans[1][2]
    assert a >= 1 and b >= 1 and a + b == len(out.token_ids)  # no drain: it ran on across the swap
    assert out.weight_version == 1
    assert engine.metrics.registry.get_sample_value("moerl_rollout_swaps_in_flight_total") == 1
    assert engine.metrics.registry.get_sample_value("moerl_rollout_rows_at_swap_total") == 1

    # The reference: the same row in a decoder of its own, version 0 for a tokens, then version 1 copied into the
    # same tensors (as Replica.swap installs) and decoded on from the KV cache it has: the same tokens and
    # logprobs, the ones after the swap included (sampling is counter-based on (seed, row, token index)).
    model, _ = served_model(engine, 0)
    _, state1 = served_model(engine, 1)
    request = rows("running", 1, 30, 0, stop_token_ids=())[0]
    decoder = Decoder(model, slots=4, max_len=engine._max_len(), eos_ids=engine._eos_ids())  # CUDA graphs on a GPU
    seq = decoder.add(request)
    while len(seq.tokens) < a:
        decoder.step()
    assert len(seq.tokens) == a
    install(model, state1)
    decoder.load_weights()
    while decoder.busy:
        decoder.step()
    assert seq.tokens == out.token_ids and seq.logprobs == pytest.approx(out.logprobs, abs=1e-6)

    # ... and not what either version alone gives: the token after the swap scored by version 1 over the whole
    # context (its own keys and values for the first a tokens too) has another logprob, and version 0 decoding
    # on would have sampled other tokens.
    v1, _ = served_model(engine, 1)
    context = torch.tensor([list(request.prompt_ids) + out.token_ids[:a + 1]], device=engine.replica.device)
    with torch.no_grad():
        logits = v1(context).logits[0, len(request.prompt_ids) + a - 1].float()
    recomputed = torch.log_softmax(logits, -1)[out.token_ids[a]].item()
    assert abs(recomputed - out.logprobs[a]) > 1e-3
    (on_v0,) = decode_once(engine.cache_dir.parent / "v0", "inflight")
    assert on_v0.token_ids[:a] == out.token_ids[:a] and on_v0.logprobs[a:] != pytest.approx(out.logprobs[a:], abs=1e-3)


def test_the_same_version_number_of_a_new_lineage_is_loaded_and_reported(engine, tmp_path):
    from moe_rl_eks.workloads.model import MoETransformer
    from moe_rl_eks.workloads.model.checkpoint import save_hf
    from moe_rl_eks.workloads.rollout.engine import VersionRef

    (first,) = engine.submit(rows("a", 1, 4, 3, stop_token_ids=())).result(timeout=60)
    assert (first.weight_version, first.weight_lineage, engine.health().lineage) == (0, 0, 0)
    staging = tmp_path / "restarted"
    torch.manual_seed(9)  # a trainer restarted from a checkpoint: lineage 1 publishes its own version 0
    save_hf(MoETransformer(engine.run.model).state_dict(), engine.run.model, staging)
    engine.store.publish(0, staging, lineage=1)
    assert engine.load_version(0) > 0  # the number alone means the newest lineage: other weights, loaded
    (second,) = engine.submit(rows("b", 1, 4, 3, stop_token_ids=())).result(timeout=60)
    assert (second.weight_version, second.weight_lineage, engine.lineage) == (0, 1, 1)
    assert second.token_ids != first.token_ids
    assert engine.load_version(VersionRef(1, 0)) == 0.0  # already served
