"""The orchestrator's HTTP API (batches, versions, records of trained batches, state) fuzzed on 127.0.0.1 with 10,000 seeded requests: a few
hundred from its own /openapi.json through the rollout server's generator (rl_helpers.fuzz_openapi: valid per the
schema and hostile), the rest from a cheap seeded generator of hostile bodies and queries the schema does not
describe (numbers past 64 bits, wrong types, duplicate and extra keys, deep nesting, bytes that are not JSON or
not UTF-8). None may get a 5xx, and a refused one (4xx) must leave the orchestrator's state as it was. Its one
rollout endpoint is a closed port, so nothing completes: the state moves only through the requests (a version
post lets the dispatcher issue prompts, which the check waits out before it reads the state a refused request
must keep). The hostile requests and the state reads share one keep-alive connection. About 35 s on the 2-core
machine."""
import json
import random
import time
import urllib.parse

import pytest
from rl_helpers import KeepAlive, fuzz_openapi, tiny_run

from moe_rl_eks.workloads.orchestrator.app import build, make_app
from moe_rl_eks.workloads.rl.runtime import BackgroundServer

# 10,000 requests against a clock (the dispatcher waited out): never beside the real RL loop's runs on a 2-core
# machine (make test's workers)
pytestmark = pytest.mark.xdist_group("rl_loop")

REQUESTS = 10_000
SCHEMA_EXAMPLES_PER_MODE = 200  # schemathesis draws ~15 ms a case here: the bulk comes from hostile_requests
NUMBERS = [-1, 0, 1, 3, 2**31, 2**63, 2**64, 10**30, -(2**63) - 1, 1.0, 1.5, -0.0, 1e308]
VALUES = NUMBERS + ["1", "", "NaN", None, True, False, [], [1], {}, {"version": 1}, "\u0000", "é" * 40]


def hostile_requests(rng: random.Random, n: int):
    """(method, path with query, raw body or None, content type) for the four trainer-facing operations."""
    for _ in range(n):
        kind = rng.randrange(7)
        if kind <= 2:  # a version post: its fields' values and keys wrong in every way
            body = {k: rng.choice(VALUES) for k in rng.sample(["version", "lineage", "extra", "Version"], rng.randint(0, 4))}
            raw = json.dumps(body if rng.random() < 0.9 else rng.choice(VALUES)).encode()
            if rng.random() < 0.1:
                raw = raw[:rng.randrange(len(raw) + 1)]  # truncated
            yield "POST", "/v1/version", raw, rng.choice(["application/json", "text/plain", ""])
        elif kind == 3:  # raw bytes: nesting past the parser's depth, not UTF-8, NUL, a duplicate key
            raw = rng.choice([b"[" * 5000 + b"]" * 5000, b'{"version": ' * 3000, b"\xff\xfe\x00{", b"\x00",
                              b'{"version": 1, "version": "x"}', b'{"version": 1e999}', b'{"version": -0}',
                              b'{"version": 1' + b"0" * 5000 + b"}", b" " * 10_000])
            yield "POST", "/v1/version", raw, "application/json"
        elif kind == 4:  # a batch request: steps and committed steps as no trainer sends them
            query = [(k, str(rng.choice(NUMBERS + ["", "x", "1e3", "0x10", " 2", "1_0", "٣"])))
                     for k in rng.choices(["step", "committed", "step", "other"], k=rng.randint(0, 4))]
            yield "GET", "/v1/batch?" + urllib.parse.urlencode(query), None, ""
        elif kind == 5:  # a record of trained batches: steps and request ids as no trainer sends them
            batches = {str(rng.choice(NUMBERS + ["x", "-1"])): rng.choice([[rng.choice(["p0", "p1", "p01", "x", ""])
                                                                          for _ in range(rng.randint(0, 3))],
                                                                         rng.choice(VALUES)])
                       for _ in range(rng.randint(0, 3))}
            body = {"batches": batches} if rng.random() < 0.8 else rng.choice(VALUES)
            yield "POST", "/v1/trained", json.dumps(body).encode(), "application/json"
        else:  # the state, asked with a body and a query it takes no notice of
            yield "GET", "/v1/state?" + urllib.parse.urlencode({"step": rng.choice(NUMBERS)}), b"{", "application/json"


def read_state(client: KeepAlive) -> str:
    return json.dumps(client.call("GET", "/v1/state")[1], sort_keys=True)


def settled_state(client: KeepAlive) -> str:
    """/v1/state once two reads 20 ms apart agree (the dispatcher issues a version's budget just after its post)."""
    last = None
    while True:
        now = read_state(client)
        if now == last:
            return now
        last = now
        time.sleep(0.02)


def test_10000_fuzzed_requests_get_no_5xx_and_a_refused_one_changes_no_state(tmp_path):
    run = tiny_run(tmp_path, training={"prompts_per_step": 2}, algorithm={"group_size": 2})
    orch = build(run, ["http://127.0.0.1:9"], token=None, events_path=tmp_path / "events.jsonl")
    http = BackgroundServer(make_app(orch, batch_poll_s=0.01)).start()
    # one keep-alive connection for the hostile requests and the state reads: a new one for each of the ~18,000
    # would cost more than the requests
    url, client, statuses = http.url, KeepAlive(http.url), []
    before = {"state": settled_state(client)}

    def check(path: str, status: int, where: str) -> None:
        assert status < 500, f"{where} -> {status}"
        if 400 <= status < 500:
            assert read_state(client) == before["state"], f"{where} -> {status} changed the state"
        elif path == "/v1/version":  # accepted: the dispatcher may issue prompts just after it
            before["state"] = settled_state(client)
        elif path == "/v1/batch":  # accepted (200 or 202): may forget committed batches, synchronously
            before["state"] = read_state(client)
        statuses.append((path.split("?")[0], status))

    try:
        fuzz_openapi(url, SCHEMA_EXAMPLES_PER_MODE,
                     lambda mode, case, response: check(case.path, response.status_code,
                                                        f"{mode} {case.method} {case.path} {case.query!r:.200} "
                                                        f"{case.body!r:.300} {response.text[:300]}"))
        for method, path, raw, content_type in hostile_requests(random.Random(0), REQUESTS - len(statuses)):
            status, body = client.call(method, path, raw=raw, headers={"Content-Type": content_type})
            check(path, status, f"{method} {path} {raw[:200] if raw else raw!r} {str(body)[:300]}")
        health = client.call("GET", "/health")[0]
    finally:
        client.close()
        http.stop()
    assert len(statuses) >= REQUESTS and health == 200
    by_path = {(p, s) for p, s in statuses}
    # refusals of both kinds (400 malformed, 409 a step it cannot serve or a record that does not fit), and
    # accepted version posts and polls
    assert {("/v1/version", 400), ("/v1/batch", 400), ("/v1/batch", 409), ("/v1/version", 200),
            ("/v1/batch", 202), ("/v1/state", 200), ("/v1/trained", 400), ("/v1/trained", 409)} <= by_path, \
        sorted(by_path)
    # a version post far past the next batch to form moved no budget: what was issued is one step's worth
    pending = json.loads(before["state"])["pending"]
    assert len(pending) <= (run.rl.orchestrator.max_staleness + 1) * 2, len(pending)
