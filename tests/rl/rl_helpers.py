"""Helpers shared by the RL tests: tiny run files, published initial weights, JSON over HTTP, schema fuzzing,
sample accounting."""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml

from moe_rl_eks.core.run import load_run
from moe_rl_eks.workloads.rl.runtime import read_jsonl

REPO = Path(__file__).resolve().parents[2]
LOCAL_RUN = REPO / "configs" / "runs" / "local.yaml"


def write_run(tmp_path: Path, name: str = "run", **rl_sections) -> Path:
    """configs/runs/local.yaml with its output under tmp_path and the given `rl:` sections (and `rollout`,
    `model`) updated; the file is what the role processes read."""
    data = yaml.safe_load(LOCAL_RUN.read_text())
    rl = data.setdefault("rl", {})
    rl.setdefault("training", {})["output_dir"] = str(tmp_path / "out")
    for section, changes in rl_sections.items():
        if section in ("rollout", "model"):
            data[section].update(changes)
        else:
            rl.setdefault(section, {}).update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def tiny_run(tmp_path: Path, **rl_sections):
    return load_run(write_run(tmp_path, **rl_sections))


def rewarded_batch(step: int = 0):
    """One trainer batch (protocol.Batch) of a prompt's two completions: token 9 rewarded (+1), token 10
    penalised (-1)."""
    from moe_rl_eks.workloads.rl.protocol import Batch, BatchStats, TrainingSample, VersionRef, one_version

    samples = [TrainingSample(f"p0/{i}", [1, 6, 13, 6, 16], completion, [-2.0] * len(completion), reward, adv, True,
                              one_version(VersionRef(0, 0), len(completion)))
               for i, (completion, reward, adv) in enumerate([([9, 2], 1.0, 1.0), ([10, 2], -1.0, -1.0)])]
    return Batch(step, 0, samples, BatchStats(0.0, 0.5, 0.0, 0, 0, 0, 0, 2))


def publish_initial(run, store, version: int = 0, seed: int = 0, lineage: int = 0) -> dict:
    from moe_rl_eks.workloads.model import MoETransformer
    from moe_rl_eks.workloads.model.checkpoint import save_hf

    torch.manual_seed(seed)
    state = MoETransformer(run.model).state_dict()
    staging = Path(store.root).parent / f"src-{lineage}-{version}"
    save_hf(state, run.model, staging)
    store.publish(version, staging, lineage=lineage)
    return state


def call(method: str, url: str, body=None, *, raw: bytes | None = None, headers: dict | None = None,
         timeout: float = 30):
    """-> (status, parsed JSON or text), never raising on 4xx/5xx."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    return status, parsed(text)


def parsed(text: str):
    """An answer's JSON, or its text where it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class KeepAlive:
    """`call` over one HTTP/1.1 keep-alive connection to a server, reopened only after an answer that closes it:
    for tests that send thousands of requests, where opening a connection for each costs more than the request."""

    def __init__(self, url: str, timeout: float = 30) -> None:
        target = urllib.parse.urlsplit(url)
        self.host, self.port, self.timeout = target.hostname, target.port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, *, raw: bytes | None = None, headers: dict | None = None):
        """-> (status, parsed JSON or text) of `path` (with its query); a connection the server dropped without
        an answer raises."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        self.conn.request(method, path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
        resp = self.conn.getresponse()
        status, text = resp.status, resp.read().decode()
        if resp.will_close:
            self.close()
        return status, parsed(text)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def fuzz_openapi(url: str, examples_per_mode: int, check, headers: dict | None = None):
    """schemathesis against `url`/openapi.json: `examples_per_mode` seeded requests to every operation in each
    generation mode (valid per the schema, and hostile: wrong types, out of range, missing fields).
    `check(mode, case, response)` asserts what must hold; returns the Counter of (mode, path, status)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    statuses: Counter = Counter()
    for mode in GenerationMode:
        @settings(max_examples=examples_per_mode, derandomize=True, database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(mode))
        def fuzz(case):
            response = case.call(base_url=url, headers=headers, timeout=30)
            check(mode.value, case, response)
            statuses[(mode.value, case.path, response.status_code)] += 1
        fuzz()
    return statuses


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def trained_history(out: Path) -> list[dict]:
    """trained.jsonl's rows that the run kept, in order: a trainer resumed from its checkpoint of step k trains
    step k again, and the dead trainer's rows from step k on (its work past the checkpoint) are rolled back."""
    rows: list[dict] = []
    for row in read_jsonl(out / "trained.jsonl"):
        rows = [r for r in rows if r["step"] < row["step"]] + [row]
    return rows


def check_trained(out: Path, max_staleness: int) -> list[dict]:
    """What every process test proves of the samples trained: no sample id trains twice (keyed by id, so a step
    trained twice shows), and each sample's tokens' weights are at most `max_staleness` versions behind its step, never
    ahead, and in the trainer's history (its own lineage, or an older one's up to where the trainer's began).
    Returns the kept rows."""
    rows = trained_history(out)
    twice = sorted(i for i, n in Counter(i for r in rows for i in r["ids"]).items() if n > 1)
    assert not twice, f"sample ids trained twice: {twice[:10]}"
    began = {}
    for r in rows:
        began.setdefault(r["lineage"], r["step"])
    for r in rows:
        for sample, spans in zip(r["ids"], r["versions"]):
            for lineage, version, _ in spans:  # every token's weights (an in-flight swap gives several spans)
                where = f"step {r['step']} (lineage {r['lineage']}) trained {sample} of version {version} ({lineage})"
                assert 0 <= r["step"] - version <= max_staleness, where + f": staleness past {max_staleness}"
                assert lineage == r["lineage"] or (lineage < r["lineage"] and version <= began[r["lineage"]]), \
                    where + ": weights outside the trainer's history"
    return rows


def trained_steps(out: Path) -> dict[int, list[str]]:
    """Sample ids trained at each step the run kept (trained_history)."""
    return {r["step"]: r["ids"] for r in trained_history(out)}


def sample_accounting(out: Path, final_state: dict, max_staleness: int) -> dict:
    """check_trained, and: every completed request is trained, dropped as stale, filtered, or still
    buffered/batched at the end — exactly once. Returns the sets for the test's own assertions. `final_state` is
    the orchestrator's state at some moment; requests that completed after it (the events file is read later, and
    an answer still in flight can land in between) are left out by the state's own count of completions."""
    check_trained(out, max_staleness)
    events = [json.loads(line) for line in (out / "orchestrator-events.jsonl").read_text().splitlines()]
    completed = [e["request_id"] for e in events if e["event"] == "completed"]
    assert len(completed) == len(set(completed)), "a request completed twice"
    assert len(completed) >= final_state["counts"]["completed"], "a completion counted in the state has no event"
    completed = completed[:final_state["counts"]["completed"]]
    # (a group that completed after the state can be dropped or filtered after it too)
    dropped = {e["request_id"] for e in events if e["event"] == "dropped_stale"} & set(completed)
    filtered = {e["request_id"] for e in events if e["event"] in ("filtered", "dropped_failed")} & set(completed)
    trained_ids = [i for ids in trained_steps(out).values() for i in ids]
    trained_requests = {i.split("/")[0] for i in trained_ids}
    leftover = {g["request_id"] for g in final_state["buffered"]}
    leftover |= {s["id"].split("/")[0] for b in final_state["batches"].values() for s in b["samples"]} - trained_requests
    assert len(trained_ids) == len(set(trained_ids)), "a sample was trained twice"
    assert trained_requests | dropped | filtered | leftover == set(completed), "a completed sample was lost"
    assert not (trained_requests & (dropped | filtered | leftover)), "a sample was both trained and discarded"
    return {"completed": set(completed), "trained": trained_requests, "dropped": dropped, "leftover": leftover,
            "trained_ids": trained_ids}


class FaultProxy:
    """A rollout server as the orchestrator sees it through a fault: each completion request is held `delay_s`
    before it is forwarded (a straggler: its answer comes late); `on_load`, if given, is called once, in a thread,
    as the first weight load after it is set reaches the server (to kill the server while it loads). Everything
    else passes straight through."""

    def __init__(self, target: str, delay_s: float = 0.0) -> None:
        self.target, self.delay_s, self.held = target, delay_s, 0
        self.on_load = None
        proxy, lock = self, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
                if self.path == "/v1/completions":
                    with lock:
                        proxy.held += 1
                    time.sleep(proxy.delay_s)
                fault = None
                if self.path == "/v1/weights/load":
                    with lock:
                        fault, proxy.on_load = proxy.on_load, None
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                target = urllib.parse.urlsplit(proxy.target)
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    if fault is not None:  # the server has the load request: it dies handling it
                        fault()
                    resp = conn.getresponse()
                    status, data = resp.status, resp.read()
                except OSError:
                    status, data = 502, b'{"error": {"message": "rollout server unreachable"}}'
                finally:
                    conn.close()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the orchestrator gave up on this request
                    pass

            do_GET = do_POST = forward

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_rollout(tmp_path, tokenizer=None, **rollout):
    """A generator fixture's body: a rollout server (FastAPI on loopback, token "s3cret") serving version 0 of a
    tiny model, with the `rollout:` settings given."""
    from moe_rl_eks.workloads.rollout.engine import RolloutEngine
    from moe_rl_eks.workloads.rollout.server import RolloutServer, make_app
    from moe_rl_eks.workloads.rl.runtime import BackgroundServer
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer
    from moe_rl_eks.workloads.rl.weights import DirectoryStore

    run = tiny_run(tmp_path, sampling={"max_n": 4, "max_prompt_tokens": 16}, algorithm={"group_size": 4},
                   rollout=rollout)
    store = DirectoryStore(tmp_path / "weights")
    publish_initial(run, store)
    tokenizer = tokenizer or CharTokenizer()
    engine = RolloutEngine(run, store, tmp_path / "cache", tokenizer)
    server = RolloutServer(run, engine, tokenizer, token="s3cret")
    server.load_version(0)
    http = BackgroundServer(make_app(server)).start()
    yield {"url": http.url, "engine": engine, "server": server, "store": store, "run": run}
    http.stop()
    engine.stop()


# The rollout engine decodes on its GPU; the CUDA cases run on the H200 through the device tool.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
