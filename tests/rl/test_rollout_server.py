"""The rollout server's HTTP contract: OpenAI-shaped completions with versions, logprobs and routing; every bad
value refused with a 400 naming it before it reaches a batch; stop strings, streaming, weights, health, metrics."""
import json
import logging
import socket
import threading
import time

import pytest
import torch

from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
from moe_rl_eks.workloads.rl.protocol import RoutingRef
from moe_rl_eks.workloads.rl.routing_store import RoutingStore

from rl_helpers import call, publish_initial, serve_rollout

AUTH = {"Authorization": "Bearer s3cret"}
PROMPT_IDS = [1, 6, 13, 7, 16]  # <bos> 3 + 4 =


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the tests that only read from it (a fresh one per test costs more than the test)."""
    yield from serve_rollout(tmp_path_factory.mktemp("shared"))


def complete(url, **body):
    status, answer = call("POST", f"{url}/v1/completions", {"prompt": "3+4=", "max_tokens": 4, **body})
    assert status == 200, answer
    return answer


def test_completion_from_text_and_token_ids_carries_version_logprobs_and_routing(rollout):
    url = rollout["url"]
    body = complete(url, n=3, temperature=1.0, top_p=0.9, seed=7, logprobs=0, return_routing=True,
                    return_token_ids=True, model="local")
    assert body["object"] == "text_completion" and body["weight_version"] == 0 and body["weight_lineage"] == 0
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    cfg = rollout["run"].model
    for choice in body["choices"]:
        n = len(choice["token_ids"])
        assert 1 <= n <= 4 and len(choice["logprobs"]["token_logprobs"]) == n
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
        assert choice["logprobs"]["top_logprobs"] is None  # logprobs: 0 = the sampled token's only
        assert choice["finish_reason"] in ("stop", "length") and choice["prompt_token_ids"] == PROMPT_IDS
        ref = RoutingRef.from_json(choice["routing_ref"])  # the arrays are in the run's routing store, not here
        routing = RoutingStore.of(rollout["run"]).read(ref)
        # one row per fed position (5 prompt tokens, then completion[:-1]), per layer the top-k expert ids
        assert routing.shape == (5 + n - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        assert routing.dtype == "uint8" and routing.max() < cfg.num_experts
    completion = sum(len(c["token_ids"]) for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion}
    again = complete(url, prompt=PROMPT_IDS, n=3, top_p=0.9, seed=7, logprobs=0)
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]
    assert again["choices"][0].get("routing_ref") is None


def test_seeds_reproduce_per_choice_up_to_the_largest_uint64(shared):
    url = shared["url"]
    for seed in (0, 2**63, 2**64 - 1):  # 2**63 and up failed every request of its batch before
        first = complete(url, n=4, seed=seed, max_tokens=6)
        assert complete(url, n=4, seed=seed, max_tokens=6)["choices"] == first["choices"]
    ids = [c["token_ids"] for c in complete(url, n=4, seed=5, max_tokens=6)["choices"]]
    assert len({tuple(i) for i in ids}) > 1  # each choice has its own stream, not the seed's one


def test_models_health_ready_and_metrics(rollout):
    url = rollout["url"]
    models = call("GET", f"{url}/v1/models")[1]["data"]
    assert models[0]["id"] == "local" and models[0]["created"] > 0 and models[0]["weight_version"] == 0
    status, health = call("GET", f"{url}/health")
    assert status == 200 and health["status"] == "ok" and health["weight_version"] == 0
    status, ready = call("GET", f"{url}/ready")
    assert status == 200 and {k: ready[k] for k in ("ready", "weight_version", "weight_lineage")} == {
        "ready": True, "weight_version": 0, "weight_lineage": 0}
    body = complete(url, max_tokens=3, n=2, seed=1)
    generated = sum(len(c["token_ids"]) for c in body["choices"])
    # the per-row decode rate the orchestrator derives deadlines from: measured once rows have decoded
    assert call("GET", f"{url}/ready")[1]["row_tokens_per_s"] > 0
    assert call("GET", f"{url}/health")[1]["row_tokens_per_s"] > 0
    status, text = call("GET", f"{url}/metrics")
    assert status == 200
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples["moerl_rollout_requests_total"] == 1 and samples["moerl_rollout_weight_version"] == 0
    assert samples["moerl_rollout_prompt_tokens_total"] == 5
    assert samples["moerl_rollout_generation_tokens_total"] == generated
    assert samples["moerl_rollout_e2e_request_latency_seconds_count"] == 1
    assert samples["moerl_rollout_time_to_first_token_seconds_count"] == 2  # one per row
    assert samples["moerl_rollout_inter_token_latency_seconds_count"] == generated - 2
    assert sum(v for k, v in samples.items() if k.startswith("moerl_rollout_request_success_total{")) == 2
    assert {"moerl_rollout_num_requests_running", "moerl_rollout_num_requests_waiting"} <= set(samples)
    assert call("POST", f"{url}/v1/completions", {"prompt": "1+1=", "n": 0})[0] == 400
    assert 'moerl_rollout_request_errors_total{status="400"} 1.0' in call("GET", f"{url}/metrics")[1]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_8_mib_is_refused_with_413(shared, chunked):
    host, port = shared["url"].removeprefix("http://").split(":")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port))) as s:
        if chunked:  # no length up front: refused once the bytes read pass the limit
            s.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
            piece = b"x" * (1 << 20)
            try:
                for _ in range(9):
                    s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except OSError:  # the server answered and closed while we were still sending
                pass
        else:  # refused from the header alone, before any of it is read
            s.sendall(head + b"Content-Length: 9000000\r\n\r\n{")
        answer = b""
        while b"}}" not in answer and (more := s.recv(65536)):  # the status line, then the JSON body
            answer += more
    assert answer.startswith(b"HTTP/1.1 413") and b'"code":"body_too_large"' in answer


@pytest.mark.parametrize("raw, param, status", [
    (b"{not json", None, 400),
    (b'["a list"]', None, 400),
    (b'{"prompt": "1+1=", "n": "3"}', "n", 400),
    (b'{"prompt": "1+1=", "n": true}', "n", 400),
    (b'{"prompt": "1+1=", "n": 5}', "n", 400),  # max_n is 4
    (b'{"prompt": "1+1=1+1=1+1=1+1=1+1="}', "prompt", 400),  # 21 tokens > max_prompt_tokens 16
    (b'{"prompt": "hello"}', "prompt", 400),  # not in the built-in vocabulary
    (b'{"prompt": [1, 99]}', "prompt", 400),  # token id outside the vocabulary
    (b'{"prompt": [1, -1]}', "prompt", 400),
    (b'{"prompt": []}', "prompt", 400),
    (b'{}', "prompt", 400),
    (b'{"prompt": "1+1=", "max_tokens": 0}', "max_tokens", 400),
    (b'{"prompt": "1+1=", "max_tokens": 9}', "max_tokens", 400),  # rollout.max_new_tokens is 8
    (b'{"prompt": "1+1=", "temperature": -1}', "temperature", 400),
    (b'{"prompt": "1+1=", "temperature": NaN}', "temperature", 400),
    (b'{"prompt": "1+1=", "temperature": Infinity}', "temperature", 400),
    (b'{"prompt": "1+1=", "top_p": 0}', "top_p", 400),
    (b'{"prompt": "1+1=", "top_k": 33}', "top_k", 400),  # the vocabulary has 32 tokens
    (b'{"prompt": "1+1=", "min_p": 1.5}', "min_p", 400),
    (b'{"prompt": "1+1=", "seed": 18446744073709551616}', "seed", 400),  # 2**64
    (b'{"prompt": "1+1=", "seed": -1}', "seed", 400),
    (b'{"prompt": "1+1=", "logprobs": 21}', "logprobs", 400),
    (b'{"prompt": "1+1=", "stop": [""]}', "stop", 400),
    (b'{"prompt": "1+1=", "stop_token_ids": [32]}', "stop_token_ids", 400),
    (b'{"prompt": "1+1=", "logprob_mode": "sampled"}', "logprob_mode", 400),
    (b'{"prompt": "1+1=", "echo": true, "logprobs": 1, "stream": true}', "stream", 400),  # answered whole
    (b'{"prompt": "1+1=", "model": "gpt-4"}', "model", 404),
])
def test_bad_requests_get_an_openai_error_naming_the_field_and_the_server_keeps_serving(shared, raw, param, status):
    url = shared["url"]
    got, body = call("POST", f"{url}/v1/completions", raw=raw)
    assert got == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["param"] == param
    assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param:
        assert body["error"]["message"].startswith(f"{param}")
    assert complete(url, max_tokens=2)["choices"]


def test_nulls_mean_defaults_and_unknown_fields_are_ignored_with_a_warning(shared, caplog):
    with caplog.at_level(logging.WARNING, logger="moe_rl_eks.workloads.rollout.server"):
        body = complete(shared["url"], n=None, temperature=None, top_p=None, seed=None, max_tokens=None,
                        stop=None, logprobs=None, best_of=3, user="x")
    assert len(body["choices"]) == 1 and 1 <= len(body["choices"][0]["token_ids"]) <= 8
    assert "ignoring unknown fields best_of, user" in caplog.text


def test_a_stop_string_ends_the_text_before_it_and_cancels_the_row(shared):
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer

    url, decode = shared["url"], CharTokenizer().decode
    for seed in range(50):  # a completion with two printable characters after its first (the tiny model babbles)
        full = complete(url, prompt="1+", max_tokens=8, seed=seed)["choices"][0]
        text = full["text"]
        at = next((i for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2]), None)
        if at is not None:
            break
    stop = text[at:at + 2]
    cut = complete(url, prompt="1+", max_tokens=8, seed=seed, stop=["@@", stop], logprobs=0)["choices"][0]
    assert cut["text"] == text[:text.index(stop)]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    kept = len(cut["token_ids"])
    assert cut["token_ids"] == full["token_ids"][:kept] and len(cut["logprobs"]["token_logprobs"]) == kept
    # the tokens kept are exactly those up to the one that completed the stop string
    assert stop in decode(cut["token_ids"]) and stop not in decode(cut["token_ids"][:-1])


def test_a_stop_token_id_ends_the_row_and_is_reported(shared):
    url = shared["url"]
    full = complete(url, prompt="1+", max_tokens=8, seed=3)["choices"][0]
    token = full["token_ids"][2]
    first = full["token_ids"].index(token)
    cut = complete(url, prompt="1+", max_tokens=8, seed=3, stop_token_ids=[token])["choices"][0]
    assert cut["token_ids"] == full["token_ids"][:first + 1]  # the stop token is part of token_ids
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == token
    assert cut["text"] == full["text"][:first]  # ... but not of the text


def test_top_logprobs_are_the_most_likely_alternatives(shared):
    choice = complete(shared["url"], max_tokens=3, seed=2, logprobs=3, temperature=0)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["top_logprobs"]) == len(choice["token_ids"])
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the best
        assert top.get(token, logprob) == pytest.approx(logprob, abs=1e-5)
    assert lp["text_offset"] == list(range(len(choice["token_ids"])))


def test_echo_prepends_the_prompt(shared):
    choice = complete(shared["url"], prompt="3+4=", max_tokens=2, seed=1, echo=True)["choices"][0]
    plain = complete(shared["url"], prompt="3+4=", max_tokens=2, seed=1)["choices"][0]
    assert choice["text"] == "3+4=" + plain["text"]


def sse(url, body):
    """The data lines of a server-sent-event answer, parsed (the last is [DONE])."""
    import httpx

    with httpx.stream("POST", url, json=body, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_completions_add_up_to_the_unstreamed_answer(shared):
    url = shared["url"]
    request = {"prompt": "2+2=", "n": 2, "max_tokens": 6, "seed": 11, "logprobs": 0, "stop": ["3+"],
               "return_token_ids": True}
    whole = complete(url, **request)
    chunks = sse(f"{url}/v1/completions", {**request, "stream": True, "stream_options": {"include_usage": True}})
    for i, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [t for c in mine for t in c["token_ids"] or []] == choice["token_ids"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["weight_version"] == 0 for c in chunks)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_has_its_rows_cancelled(tmp_path, stream):
    for server in serve_rollout(tmp_path, max_new_tokens=48):
        engine = server["engine"]
        # a seed whose completion runs long (the tiny random model may end a row early with <eos>)
        seed = next(s for s in range(100) if len(complete(server["url"], prompt="1+", max_tokens=40, seed=s)
                                                   ["choices"][0]["token_ids"]) >= 20)
        sampled = []
        real_submit = engine.submit

        def slow_submit(rows, on_tokens=None):  # sampling slower than the client's patience: it hangs up early
            def on(events):
                sampled.extend(events)
                time.sleep(0.02)
                if on_tokens is not None:
                    on_tokens(events)
            return real_submit(rows, on)
        engine.submit = slow_submit
        host, port = server["url"].removeprefix("http://").split(":")
        body = json.dumps({"prompt": "1+", "max_tokens": 40, "stream": stream, "seed": seed}).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            if stream:
                received = b""
                while b"data: " not in received:  # the headers, then the first tokens' event
                    received += s.recv(4096)
            else:
                while not sampled:  # the rows are running
                    time.sleep(0.01)
        aborted = 'moerl_rollout_request_success_total{finished_reason="abort"} 1.0'
        deadline = time.monotonic() + 10
        while aborted not in call("GET", f"{server['url']}/metrics")[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aborted in call("GET", f"{server['url']}/metrics")[1]
        assert len(sampled) < 20  # cancelled, not run to its end


def test_weight_loading_needs_the_token_and_switches_version_and_lineage(rollout):
    url, store = rollout["url"], rollout["store"]
    publish_initial(rollout["run"], store, version=1, seed=1)
    assert call("POST", f"{url}/v1/weights/load", {"version": 1})[0] == 401
    assert call("POST", f"{url}/v1/weights/load", {"version": 1}, headers={"Authorization": "Bearer nope"})[0] == 401
    assert call("POST", f"{url}/v1/weights/load", {"version": "x"})[0] == 401  # no token, no parsing
    status, body = call("POST", f"{url}/v1/weights/load", {"version": "1"}, headers=AUTH)
    assert status == 400 and body["error"]["param"] == "version"
    status, body = call("POST", f"{url}/v1/weights/load", {"version": 7}, headers=AUTH)
    assert status == 409 and "version 7" in body["error"]["message"] and body["error"]["type"] == "conflict_error"
    status, body = call("POST", f"{url}/v1/weights/load", {"version": 1}, headers=AUTH)
    assert status == 200 and (body["weight_version"], body["weight_lineage"]) == (1, 0)
    # the trainer restarted from a checkpoint: lineage 1 publishes its own version 1, which is other weights
    publish_initial(rollout["run"], store, version=1, seed=2, lineage=1)
    status, body = call("POST", f"{url}/v1/weights/load", {"version": 1, "lineage": 1}, headers=AUTH)
    assert status == 200 and (body["weight_version"], body["weight_lineage"]) == (1, 1)
    answer = complete(url, max_tokens=2)
    assert (answer["weight_version"], answer["weight_lineage"]) == (1, 1)
    ready = call("GET", f"{url}/ready")[1]
    assert (ready["ready"], ready["weight_version"], ready["weight_lineage"]) == (True, 1, 1)
    status, body = call("POST", f"{url}/v1/weights/load", {"version": 1, "lineage": 5}, headers=AUTH)
    assert status == 409 and call("GET", f"{url}/ready")[1]["weight_lineage"] == 1
    status, body = call("GET", f"{url}/nowhere")
    assert status == 404 and body["error"]["type"] == "not_found_error"


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


def test_without_weights_generation_answers_503_and_ready_says_so(tmp_path):
    from moe_rl_eks.workloads.rollout.engine import RolloutEngine
    from moe_rl_eks.workloads.rollout.server import RolloutServer, make_app
    from moe_rl_eks.workloads.rl.runtime import BackgroundServer
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer
    from moe_rl_eks.workloads.rl.weights import DirectoryStore
    from rl_helpers import tiny_run

    run = tiny_run(tmp_path)
    engine = RolloutEngine(run, DirectoryStore(tmp_path / "weights"), tmp_path / "cache", CharTokenizer())
    http = BackgroundServer(make_app(RolloutServer(run, engine, CharTokenizer(), token=None))).start()
    try:
        assert call("GET", f"{http.url}/health")[0] == 200  # alive: a pod still loading is not restarted
        assert call("GET", f"{http.url}/ready")[0] == 503
        status, body = call("POST", f"{http.url}/v1/completions", {"prompt": "1+1="})
        assert status == 503 and body["error"]["type"] == "service_unavailable_error"
        assert body["error"]["code"] == "not_ready"
    finally:
        http.stop()
        engine.stop()


def test_health_turns_503_while_the_engine_loop_is_stuck_in_a_step(tmp_path):
    for server in serve_rollout(tmp_path, hung_after_s=1.5):
        url, engine = server["url"], server["engine"]
        assert call("GET", f"{url}/health")[0] == 200
        unstuck = threading.Event()
        # The engine thread runs a row's token callback inside its step: one that never returns is a hung loop.
        done = engine.submit([RowRequest((1, 6), SamplingParams(max_tokens=2, seed=1), "stuck", 0)],
                             on_tokens=lambda events: unstuck.wait(30))
        time.sleep(2.5)
        status, body = call("GET", f"{url}/health")
        assert status == 503 and body["status"] == "hung" and body["seconds_since_step"] > 1.5
        unstuck.set()
        done.result(timeout=30)
        assert call("GET", f"{url}/health")[0] == 200


def test_a_row_failing_inside_the_engine_fails_alone_next_to_concurrent_requests(rollout):
    """The server refuses everything the engine could fail on, so the failing row is submitted to the engine
    directly (a prompt longer than any KV-cache slot) while HTTP requests share its batches."""
    url, engine = rollout["url"], rollout["engine"]
    alone = {s: complete(url, n=2, seed=s, max_tokens=6) for s in range(4)}
    results = {}

    def send(seed):
        results[seed] = complete(url, n=2, seed=seed, max_tokens=6)
    threads = [threading.Thread(target=send, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    bad = engine.submit([RowRequest(tuple([3] * 200), SamplingParams(max_tokens=4), "bad", 0),
                         RowRequest((1, 6, 13), SamplingParams(max_tokens=4, seed=1), "bad", 1)])
    for t in threads:
        t.join(timeout=30)
    failed, fine = bad.result(timeout=30)
    assert failed.finish_reason == "error" and failed.error and fine.finish_reason in ("stop", "length")
    for s in range(4):
        assert results[s]["choices"] == alone[s]["choices"]


def test_concurrent_requests_each_get_their_own_seeded_completions(rollout):
    url = rollout["url"]
    request = {"prompt": "2+3=", "n": 4, "max_tokens": 3, "logprobs": 0}
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


def test_chat_without_a_chat_template_is_refused_naming_messages(shared):
    status, body = call("POST", f"{shared['url']}/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "1+1="}]})
    assert status == 400 and body["error"]["param"] == "messages" and "chat template" in body["error"]["message"]
    status, body = call("POST", f"{shared['url']}/v1/chat/completions", {"messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
