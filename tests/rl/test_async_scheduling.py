"""rollout.async_scheduling (Decoder look_ahead): the next decode step is queued before the host books the
current one's tokens. It samples what stepping one at a time samples: bitwise where the same rows share every
step, the same tokens where rows join later or stop early (their queued token dropped), the new weights' tokens
after a swap under a queued step; every block comes back; the engine serves with it; a sharded server refuses it."""
import numpy as np
import pytest
import torch
from rl_helpers import DEVICES, publish_initial, tiny_run, write_run

from moe_rl_eks.core.run import ConfigError, load_run
from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer
from moe_rl_eks.workloads.rl.weights import DirectoryStore
from moe_rl_eks.workloads.rollout.decoder import Decoder
from moe_rl_eks.workloads.rollout.engine import RolloutEngine
from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
from moe_rl_eks.workloads.rollout.weight_staging import install



def request(prompt, max_tokens, seed, row, **params):
    return RowRequest(tuple(prompt), SamplingParams(max_tokens, seed=seed, stop_token_ids=(), **params), "r", row)


def decode(model, rows, look_ahead, *, slots=8, join_at=None, joining=(), cancel_at=None, **sizes):
    """Step a decoder to the end; `joining` rows are added at step `join_at`, row 0 cancelled at `cancel_at`."""
    decoder = Decoder(model, slots=slots, max_len=48, eos_ids=(), look_ahead=look_ahead, **sizes)
    seqs = [decoder.add(r) for r in rows]
    step = queued = 0
    while decoder.busy or step <= (join_at or 0):
        if step == join_at:
            seqs += [decoder.add(r) for r in joining]
        if step == cancel_at:
            assert decoder.cancel(seqs[0])
        decoder.step()
        queued += bool(decoder.scheduler.in_flight)  # a step left queued on the device for the next call
        step += 1
    assert (queued > step // 2) if look_ahead else not queued
    assert decoder.stats()["blocks_free"] == decoder.stats()["blocks_total"]  # every block came back
    return seqs


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_share_every_step_sample_bitwise_what_one_step_at_a_time_samples(model, device):
    model = model.to(device)
    # uneven lengths (rows leave at different steps), filters, alternatives, routing: all start together
    rows = [request([1, 5 + i, 13, 7, 16][:3 + i % 3], 3 + 2 * i, 40 + i, i, return_routing=True,
                    top_logprobs=2 * (i % 2), top_p=0.9 if i % 3 == 0 else 1.0) for i in range(6)]
    ahead, steady = decode(model, rows, True), decode(model, rows, False)
    for a, s in zip(ahead, steady):
        assert a.tokens == s.tokens and a.logprobs == s.logprobs and a.top_logprobs == s.top_logprobs
        assert a.finish_reason == s.finish_reason == "length" and len(a.tokens) == a.params.max_tokens
        assert torch.equal(a.routing, s.routing) and len(a.routing) == len(a.prompt) + len(a.tokens) - 1


def test_a_row_that_stops_drops_its_queued_token_and_rows_joining_later_sample_the_same_tokens(model):
    rows = [request([1, 6, 13, 7, 16], 12, 7 + i, i, temperature=0.0, return_routing=True) for i in range(3)]
    greedy = decode(model, rows, False)[0].tokens
    stop = greedy[4]  # row 0 stops at its 5th token (greedy: the same tokens whatever shares its steps)
    rows[0] = RowRequest(rows[0].prompt_ids, SamplingParams(12, seed=7, temperature=0.0, return_routing=True,
                                                            stop_token_ids=(stop,)), "r", 0)
    joining = [request([1, 9, 4], 6, 70 + i, 10 + i, return_routing=True) for i in range(2)]
    ahead = decode(model, rows, True, join_at=3, joining=joining)
    steady = decode(model, rows, False, join_at=3, joining=joining)
    assert ahead[0].finish_reason == "stop" and ahead[0].tokens == greedy[:greedy.index(stop) + 1]
    for a, s in zip(ahead, steady):
        assert a.tokens == s.tokens and a.finish_reason == s.finish_reason
        assert a.logprobs == pytest.approx(s.logprobs, abs=1e-5)  # rows shared other steps: reduction order
        assert len(a.routing) == len(a.prompt) + len(a.tokens) - 1  # the dropped step's position is not its own
        assert np.array_equal(a.routing.numpy(), s.routing.numpy())


def test_a_row_cancelled_while_its_next_step_is_queued_keeps_what_it_had_and_returns_its_blocks(model):
    rows = [request([1, 6, 13, 7, 16], 20, 3 + i, i) for i in range(2)]
    ahead = decode(model, rows, True, cancel_at=4)
    steady = decode(model, rows, False, cancel_at=4)
    assert ahead[0].finish_reason == steady[0].finish_reason == "abort"
    assert ahead[0].tokens == steady[0].tokens and len(ahead[0].tokens) == 5  # 2 in the first step, then 1 a step
    assert ahead[1].tokens == steady[1].tokens and len(ahead[1].tokens) == 20


@pytest.mark.parametrize("device", DEVICES)
def test_new_weights_installed_under_a_queued_step_undo_it_and_sample_every_later_token(model, tmp_path, device):
    model = model.to(device)
    (tmp_path / "other").mkdir()
    other = tiny_run(tmp_path / "other")
    torch.manual_seed(5)
    new = {k: v.to(device) for k, v in MoETransformer(other.model).state_dict().items()}
    old = {k: v.clone() for k, v in model.state_dict().items()}
    outputs = []
    for look_ahead in (True, False):
        install(model, old)
        decoder = Decoder(model, slots=2, max_len=48, eos_ids=(), look_ahead=look_ahead)
        seq = decoder.add(request([1, 6, 13, 7, 16], 16, 11, 0, return_routing=True))
        while len(seq.tokens) < 6:
            decoder.step()
        install(model, new)
        decoder.load_weights()
        while decoder.busy:
            decoder.step()
        outputs.append(seq)
    ahead, steady = outputs
    assert ahead.tokens == steady.tokens and ahead.logprobs == steady.logprobs
    assert torch.equal(ahead.routing, steady.routing)


def test_the_engine_serves_with_async_scheduling_and_a_sharded_server_refuses_it(tmp_path):
    outputs = []
    for on in (True, False):
        (tmp_path / str(on)).mkdir()
        run = tiny_run(tmp_path / str(on), rollout={"max_batch_size": 4, "max_new_tokens": 40, "async_scheduling": on},
                       sampling={"max_n": 4, "max_prompt_tokens": 16}, algorithm={"group_size": 4})
        store = DirectoryStore(tmp_path / str(on) / "weights")
        publish_initial(run, store)
        engine = RolloutEngine(run, store, tmp_path / str(on) / "cache", CharTokenizer())
        try:
            engine.load_version(0)
            assert engine.replica.decoder.look_ahead is on
            rows = [RowRequest((1, 6, 13, 7, 16), SamplingParams(10 + 3 * i, seed=i, stop_token_ids=()), "a", i)
                    for i in range(4)]
            outputs.append(engine.submit(rows).result(timeout=60))
        finally:
            engine.stop()
    for a, s in zip(*outputs):
        assert a.token_ids == s.token_ids and a.logprobs == s.logprobs  # one request: the same rows every step
    (tmp_path / "sharded").mkdir()
    with pytest.raises(ConfigError, match=r"rollout.async_scheduling: True is not allowed; must be false with "
                                          r"gpus_per_server 2"):
        load_run(write_run(tmp_path / "sharded", rollout={"gpus_per_server": 2, "async_scheduling": True}))


def test_async_scheduling_is_on_by_default_for_a_server_of_one_gpu_and_off_for_a_sharded_one(tmp_path):
    def look_ahead(name, **rollout):
        (tmp_path / name).mkdir()
        return load_run(write_run(tmp_path / name, rollout=rollout)).rollout.look_ahead
    assert look_ahead("default") is True
    assert look_ahead("off", async_scheduling=False) is False
    assert look_ahead("sharded", gpus_per_server=2) is False
