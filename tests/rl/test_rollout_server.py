"""The rollout server's API contract: OpenAI-style completions, versions, logprobs, routing, auth, bad input."""
import queue
import threading

import pytest
import torch

from moe_rl_eks.workloads.rl.generation import Row
from moe_rl_eks.workloads.rl.rollout_server import Control, Work, take_batch

from rl_helpers import call, publish_initial

AUTH = {"Authorization": "Bearer s3cret"}


def test_completion_from_text_and_token_ids_carries_version_logprobs_and_routing(rollout):
    url = rollout["url"]
    status, body = call("POST", f"{url}/v1/completions",
                        {"prompt": "3+4=", "n": 3, "max_tokens": 4, "temperature": 1.0, "top_p": 0.9, "seed": 7,
                         "logprobs": 1, "return_routing": True, "model": "local"})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["weight_version"] == 0 and len(body["choices"]) == 3
    cfg = rollout["run"].model
    for choice in body["choices"]:
        n = len(choice["token_ids"])
        assert 1 <= n <= 4 and len(choice["logprobs"]["token_logprobs"]) == n
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
        assert choice["finish_reason"] in ("stop", "length")
        routing = choice["routed_experts"]
        # per layer: one entry per fed position (5 prompt tokens incl. <bos>, then completion[:-1]), top-k ids
        assert len(routing) == cfg.num_hidden_layers
        assert all(len(layer) == 5 + n - 1 for layer in routing)
        assert all(len(ids) == cfg.num_experts_per_tok and all(0 <= e < cfg.num_experts for e in ids)
                   for layer in routing for ids in layer)
    assert body["usage"]["prompt_tokens"] == 5
    # the same request as token ids, same seed: the same completions
    ids = [1, 6, 13, 7, 16]  # <bos> 3 + 4 =
    status, again = call("POST", f"{url}/v1/completions",
                         {"prompt": ids, "n": 3, "max_tokens": 4, "top_p": 0.9, "seed": 7, "logprobs": 1})
    assert status == 200
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]


def test_models_health_and_metrics(rollout):
    url = rollout["url"]
    assert call("GET", f"{url}/v1/models")[1]["data"][0]["id"] == "local"
    status, health = call("GET", f"{url}/health")
    assert status == 200 and health["weight_version"] == 0
    call("POST", f"{url}/v1/completions", {"prompt": "1+1=", "max_tokens": 2})
    status, text = call("GET", f"{url}/metrics")
    assert status == 200 and "moerl_rollout_requests_total 1.0" in text and "moerl_rollout_weight_version 0.0" in text


@pytest.mark.parametrize("raw, param, status", [
    (b"{not json", None, 400),
    (b'["a list"]', None, 400),
    (b'{"prompt": "1+1=", "n": "3"}', "n", 400),
    (b'{"prompt": "1+1=", "n": true}', "n", 400),
    (b'{"prompt": "1+1=", "n": 5}', "n", 400),  # max_n is 4
    (b'{"prompt": "1+1=1+1=1+1=1+1=1+1="}', "prompt", 400),  # 21 tokens > max_prompt_tokens 16
    (b'{"prompt": "hello"}', "prompt", 400),  # not in the built-in vocabulary
    (b'{"prompt": [1, 99]}', "prompt", 400),  # token id outside the vocabulary
    (b'{"prompt": []}', "prompt", 400),
    (b'{"prompt": "1+1=", "max_tokens": 0}', "max_tokens", 400),
    (b'{"prompt": "1+1=", "temperature": -1}', "temperature", 400),
    (b'{"prompt": "1+1=", "top_p": 0}', "top_p", 400),
    (b'{"prompt": "1+1=", "stop": ["\\n"]}', "stop", 400),  # unknown field
])
def test_bad_requests_get_a_json_4xx_naming_the_field_and_the_server_keeps_serving(rollout, raw, param, status):
    url = rollout["url"]
    got, body = call("POST", f"{url}/v1/completions", raw=raw)
    assert got == status and body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    assert call("POST", f"{url}/v1/completions", {"prompt": "1+1=", "max_tokens": 2})[0] == 200


def test_weight_loading_needs_the_token_and_switches_the_version(rollout, tmp_path):
    url, store = rollout["url"], rollout["store"]
    publish_initial(rollout["run"], store, version=1, seed=1)
    assert call("POST", f"{url}/v1/weights/load", {"version": 1})[0] == 401
    assert call("POST", f"{url}/v1/weights/load", {"version": 1}, headers={"Authorization": "Bearer nope"})[0] == 401
    assert call("POST", f"{url}/v1/weights/load", {"version": "1"}, headers=AUTH)[0] == 400
    status, body = call("POST", f"{url}/v1/weights/load", {"version": 7}, headers=AUTH)
    assert status == 409 and "version 7" in body["error"]["message"]
    status, body = call("POST", f"{url}/v1/weights/load", {"version": 1}, headers=AUTH)
    assert status == 200 and body["weight_version"] == 1
    assert call("POST", f"{url}/v1/completions", {"prompt": "2+2=", "max_tokens": 2})[1]["weight_version"] == 1
    assert call("GET", f"{url}/nowhere")[0] == 404


def test_a_version_of_another_shape_is_refused_and_the_served_weights_stay_whole(rollout):
    from dataclasses import replace
    from types import SimpleNamespace

    url, engine = rollout["url"], rollout["engine"]
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    wider = SimpleNamespace(model=replace(rollout["run"].model, num_experts=8))
    publish_initial(wider, rollout["store"], version=3, seed=4)
    status, body = call("POST", f"{url}/v1/weights/load", {"version": 3}, headers=AUTH)
    assert status == 409 and "the version has (8, 64, 64), the served model (4, 64, 64)" in body["error"]["message"], body
    assert call("GET", f"{url}/health")[1]["weight_version"] == 0
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())  # nothing half-loaded


def test_concurrent_requests_each_get_their_own_seeded_completions(rollout):
    # Whatever batches the server forms from concurrent requests (their composition is pinned by
    # test_take_batch_fills_up_to_max_rows_and_never_overtakes_a_weight_swap), each seed's completions are the
    # ones it gets alone.
    url = rollout["url"]
    request = {"prompt": "2+3=", "n": 4, "max_tokens": 3, "logprobs": 1}
    alone = {s: call("POST", f"{url}/v1/completions", {**request, "seed": s})[1] for s in range(8)}
    results = {}

    def send(seed):
        results[seed] = call("POST", f"{url}/v1/completions", {**request, "seed": seed})[1]
    threads = [threading.Thread(target=send, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for s in range(8):
        assert [c["token_ids"] for c in results[s]["choices"]] == [c["token_ids"] for c in alone[s]["choices"]]


def test_take_batch_fills_up_to_max_rows_and_never_overtakes_a_weight_swap():
    def work(rows):
        return Work([Row([1], 1, 1.0, 1.0, 0)] * rows, None)
    waiting = queue.Queue()
    second, third, swap, fourth = work(2), work(3), Control("swap", (5,), None), work(1)
    for item in (second, third, swap, fourth):
        waiting.put(item)
    first = work(1)
    batch, held = take_batch(first, waiting, max_rows=4)
    assert batch == [first, second] and held is third  # 1 + 2 rows; 3 more would exceed 4
    batch, held = take_batch(held, waiting, max_rows=64)
    assert batch == [third] and held == swap  # the swap ends the batch; `fourth` waits for the new weights
    assert waiting.get_nowait() is fourth
