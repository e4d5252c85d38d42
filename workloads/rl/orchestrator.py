"""Orchestrator: drives the rollout servers, scores completions, forms groups and batches, bounds staleness,
and feeds the trainers.

- Spreads requests over every healthy endpoint (least in flight first, none beyond its fair share); each
  request has a deadline and is re-sent elsewhere when its server fails or times out, and hedged on a second server when it straggles. A
  request id completes once: a late duplicate is ignored. Request seeds derive from the prompt index, so a
  retried request yields the same completions.
- Bounded staleness (AReaL's rule): no new request while consumed + buffered + in flight groups would exceed
  (trainer version + max_staleness + 1) x prompts_per_step, and requests only go to servers holding the newest
  published version; a group that still arrives too old for the step that would train it is dropped and counted.
  max_staleness 0 is synchronous on-policy training.
- Trainers fetch the batch of step s (idempotent by step, so a restarted trainer gets the batch its dead
  predecessor had fetched) and post each newly published version, which is pushed to every server.

HTTP: GET /v1/batch?step=s&committed=c (long poll), POST /v1/version {"version"}, GET /v1/state, /health, /metrics.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moe_rl_eks.core import metrics as M
from moe_rl_eks.core.cluster import ORCHESTRATOR_PORT
from moe_rl_eks.core.run import RunConfig

from .algorithms import grpo_advantages, varied_groups
from .rewards import ArithmeticTask, RewardScorer
from .runtime import HttpError, JsonHandler, Registry, HttpServer, http_json, load, output_dir, run_argparser
from .tokenizer import load_tokenizer

log = logging.getLogger(__name__)
BATCH_POLL_S = 10.0


@dataclass
class Group:
    """One prompt's completions, scored; `version` is the weight version that generated them."""

    request_id: str
    prompt_index: int
    prompt_ids: list[int]
    version: int
    samples: list[dict]  # completion_ids, logprobs, reward, finished, [routing]


@dataclass
class Server:
    url: str
    healthy: bool = False
    version: int | None = None
    in_flight: int = 0
    pushing: bool = False  # a weight load is in progress
    last_sent: float = 0.0  # monotonic time of the last request sent here


@dataclass
class Attempt:
    prompt_index: int
    started: float
    servers: list[str] = field(default_factory=list)
    failures: int = 0


class Orchestrator:
    def __init__(self, run: RunConfig, endpoints: list[str], token: str | None, events_path: Path | None = None,
                 state: dict | None = None) -> None:
        if not endpoints:
            raise ValueError("rl.orchestrator.endpoints: no rollout endpoints; list at least one base URL")
        self.run, self.token = run, token
        self.cfg, self.algo = run.rl.orchestrator, run.rl.algorithm
        self.task = ArithmeticTask(run.rl.task, run.rl.training.seed)
        self.tokenizer = load_tokenizer(run.rl.sampling.tokenizer)
        self.scorer = RewardScorer(run.rl.reward)
        self.endpoints = endpoints
        self.servers: dict[str, Server] = {}
        self.metrics = Registry()
        self.lock = threading.Condition()
        self._discover()
        # Threads start lazily; the cap only has to exceed what the in-flight limits allow across the pool.
        self.pool = ThreadPoolExecutor(max_workers=512)
        self.events = open(events_path, "a") if events_path else None
        self.running = True
        # Everything below is the orchestrator state a checkpoint records.
        self.next_prompt = 0
        self.in_flight: dict[str, Attempt] = {}  # issued and not completed, by request id
        self.retry: deque[str] = deque()  # of those, the ones no server is working on
        self.buffered: deque[Group] = deque()
        self.batches: dict[int, dict] = {}
        self.consumed = 0  # groups that went into batches
        self.trainer_version = 0
        self.published: int | None = None
        self.counts = {"completed": 0, "dropped_stale_groups": 0, "filtered_groups": 0, "retries": 0,
                       "duplicates_ignored": 0, "failed_requests": 0}
        self._failures_exported = 0
        if state:
            self._restore(state)

    # ---- state -------------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self.lock:
            return {"next_prompt": self.next_prompt, "consumed": self.consumed, "counts": dict(self.counts),
                    "trainer_version": self.trainer_version,
                    "pending_prompts": sorted(a.prompt_index for a in self.in_flight.values()),
                    "buffered": [asdict(g) for g in self.buffered],
                    "batches": {str(k): v for k, v in self.batches.items()}}

    def _restore(self, state: dict) -> None:
        self.next_prompt, self.consumed = state["next_prompt"], state["consumed"]
        self.counts.update(state["counts"])
        self.trainer_version = state["trainer_version"]
        for prompt_index in state["pending_prompts"]:  # were in flight: issued again, with the same seeds
            self.in_flight[f"p{prompt_index}"] = Attempt(prompt_index, time.monotonic())
            self.retry.append(f"p{prompt_index}")
        self.buffered.extend(Group(**g) for g in state["buffered"])
        self.batches = {int(k): v for k, v in state["batches"].items()}

    def _event(self, kind: str, **fields) -> None:
        if self.events:
            self.events.write(json.dumps({"event": kind, "t": time.time(), **fields}) + "\n")
            self.events.flush()

    # ---- rollout side ------------------------------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._health_loop, name="health", daemon=True).start()
        threading.Thread(target=self._dispatch_loop, name="dispatch", daemon=True).start()

    def stop(self) -> None:
        with self.lock:
            self.running = False
            self.lock.notify_all()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _outstanding(self) -> int:
        return self.consumed + len(self.buffered) + len(self.in_flight)

    def _budget(self) -> int:
        return (self.trainer_version + self.cfg.max_staleness + 1) * self.run.rl.training.prompts_per_step

    def _issuable(self) -> int:
        """Requests that may go out now: retries, and new prompts the staleness budget allows."""
        return len(self.retry) + max(0, self._budget() - self._outstanding())

    def queue_depth(self) -> int:
        """Requests in flight plus those the staleness budget allows but no server has room for: the demand the
        rollout autoscaler sizes the pool to (in flight alone can never exceed what the servers already hold)."""
        return len(self.in_flight) + max(0, self._budget() - self._outstanding())

    def _ready_servers(self, exclude: list[str] = ()) -> list[Server]:
        ready = [s for s in self.servers.values() if s.healthy and s.version == self.published
                 and s.in_flight < self.cfg.max_inflight_requests and s.url not in exclude]
        # Least in flight first; among equals the one sent to longest ago, so no server wins by its place in a dict.
        return sorted(ready, key=lambda s: (s.in_flight, s.last_sent))

    def _next_server(self) -> Server | None:
        """Where a new request goes: the least busy ready server, unless it already holds its fair share of the
        demand (in flight on healthy servers, plus what may be issued now) over every healthy server. A server
        still loading the published version is healthy but not ready; without the share, the burst issued when a
        version is published would pile onto whichever server loaded it first while the rest of the pool idles.
        (A load that fails marks its server unhealthy, which releases the share it held.)"""
        ready = self._ready_servers()
        if not ready:
            return None
        healthy = [s for s in self.servers.values() if s.healthy]
        share = -(-(sum(s.in_flight for s in healthy) + self._issuable()) // len(healthy))
        return ready[0] if ready[0].in_flight < share else None

    def _dispatch_loop(self) -> None:
        with self.lock:
            while self.running:
                self._issue_new()
                self._hedge_stragglers()
                self.metrics[M.ROLLOUT_QUEUE_DEPTH].set(self.queue_depth())
                self.lock.wait(timeout=0.2)

    def _issue_new(self) -> None:
        while self.published is not None and self._issuable():
            server = self._next_server()
            if server is None:
                return
            if self.retry:
                request_id = self.retry.popleft()
                attempt = self.in_flight[request_id]
            else:
                request_id = f"p{self.next_prompt}"
                attempt = self.in_flight[request_id] = Attempt(self.next_prompt, time.monotonic())
                self.next_prompt += 1
            attempt.started = time.monotonic()
            self._send(request_id, attempt, server)

    def _hedge_stragglers(self) -> None:
        now = time.monotonic()
        for request_id, attempt in list(self.in_flight.items()):
            if len(attempt.servers) == 1 and attempt.failures == 0 and now - attempt.started > self.cfg.straggler_after_s:
                others = self._ready_servers(exclude=attempt.servers)
                if others:
                    log.info("request %s straggles on %s; also sending it to %s", request_id, attempt.servers[0],
                             others[0].url)
                    self._count_retry()
                    self._send(request_id, attempt, others[0])

    def _count_retry(self) -> None:
        self.counts["retries"] += 1
        self.metrics[M.ROLLOUT_RETRIES].inc()

    def _send(self, request_id: str, attempt: Attempt, server: Server) -> None:
        attempt.servers.append(server.url)
        server.in_flight += 1
        server.last_sent = time.monotonic()
        self.pool.submit(self._request, request_id, attempt.prompt_index, server)

    def _request(self, request_id: str, prompt_index: int, server: Server) -> None:
        problem = self.task.problem(prompt_index)
        prompt_ids = self.tokenizer.encode(problem.prompt)
        s = self.run.rl.sampling
        body = {"prompt": prompt_ids, "n": self.algo.group_size, "max_tokens": s.max_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "logprobs": 1,
                "seed": self.run.rl.training.seed * 100_000 + prompt_index,
                "return_routing": self.algo.routing_replay}
        try:
            resp = http_json("POST", f"{server.url}/v1/completions", body, timeout=self.cfg.request_timeout_s)
        except Exception as exc:  # noqa: BLE001 -- any failure: try another server
            with self.lock:
                server.in_flight -= 1
                server.healthy = False
                self._failed(request_id, server, exc)
            return
        samples = []
        for choice in resp["choices"]:
            finished = choice["finish_reason"] == "stop"
            reward = self.scorer.score(problem.prompt, choice["text"], problem.answer, finished)
            sample = {"completion_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"],
                      "reward": reward, "finished": finished}
            if "routed_experts" in choice:
                sample["routing"] = choice["routed_experts"]
            samples.append(sample)
        group = Group(request_id, prompt_index, prompt_ids, resp["weight_version"], samples)
        with self.lock:
            server.in_flight -= 1
            self.metrics[M.REWARD_FAILURES].inc(self.scorer.failures - self._failures_exported)
            self._failures_exported = self.scorer.failures
            self._completed(group)
            self.lock.notify_all()

    def _failed(self, request_id: str, server: Server, exc: Exception) -> None:
        attempt = self.in_flight.get(request_id)
        if attempt is None:  # another attempt already completed it
            return
        attempt.failures += 1
        attempt.servers.remove(server.url)
        log.warning("request %s failed on %s (%s)", request_id, server.url, exc)
        if attempt.servers:  # a hedge is still running
            return
        if attempt.failures >= self.cfg.max_attempts:
            del self.in_flight[request_id]
            self.counts["failed_requests"] += 1
            self._event("failed", request_id=request_id)
            return
        self._count_retry()
        self.retry.appendleft(request_id)
        self.lock.notify_all()

    def _completed(self, group: Group) -> None:
        if self.in_flight.pop(group.request_id, None) is None:
            self.counts["duplicates_ignored"] += 1
            return
        self.counts["completed"] += 1
        self._event("completed", request_id=group.request_id, version=group.version)
        rewards = torch.tensor([[s["reward"] for s in group.samples]])
        if self.algo.dynamic_sampling and not bool(varied_groups(rewards)[0]):
            self.counts["filtered_groups"] += 1
            self.metrics[M.SAMPLES_FILTERED].inc(len(group.samples))
            self._event("filtered", request_id=group.request_id)
            return
        self.buffered.append(group)

    def _discover(self) -> None:
        """(Re)resolve the endpoints: a `dns+` endpoint stands for every address its name resolves to (a
        headless Service lists each ready rollout pod), so servers the autoscaler adds or removes are followed."""
        urls = set()
        for endpoint in self.endpoints:
            try:
                urls.update(expand_endpoint(endpoint))
            except OSError as exc:
                log.warning("cannot resolve %s: %s", endpoint, exc)
        with self.lock:
            for url in urls - set(self.servers):
                self.servers[url] = Server(url)
            for url in set(self.servers) - urls:
                del self.servers[url]  # requests still running there finish or fail over as usual

    def _health_loop(self) -> None:
        while self.running:
            self._discover()
            for server in list(self.servers.values()):
                try:
                    health = http_json("GET", f"{server.url}/health", timeout=2)
                    server.version = health["weight_version"]
                    server.healthy = True
                    if self.published is not None and server.version != self.published:
                        self._push_async(server, self.published)
                except Exception:  # noqa: BLE001 -- down or loading: no requests go there
                    server.healthy = False
            with self.lock:
                if self.published is None:
                    versions = [s.version for s in self.servers.values() if s.healthy and s.version is not None]
                    self.published = max(versions, default=None)
                self.lock.notify_all()
            time.sleep(0.5)

    def _push(self, server: Server, version: int) -> None:
        http_json("POST", f"{server.url}/v1/weights/load", {"version": version}, timeout=self.cfg.request_timeout_s,
                  token=self.token)
        server.version = version

    def publish(self, version: int) -> None:
        """A trainer published `version`: from now on requests go only to servers that hold it. Every healthy
        server is told to load it in the background (the health loop retries the others), so a slow or stuck
        server never stalls the trainer."""
        with self.lock:
            if self.published is not None and version <= self.published:
                return
            self.published = version
            self.trainer_version = max(self.trainer_version, version)
            servers = [s for s in self.servers.values() if s.healthy]
            self.lock.notify_all()
        for server in servers:
            self._push_async(server, version)

    def _push_async(self, server: Server, version: int) -> None:
        if not server.pushing:  # one load at a time per server; the health loop sends newer ones after
            server.pushing = True
            self.pool.submit(self._try_push, server, version)

    def _try_push(self, server: Server, version: int) -> None:
        try:
            self._push(server, version)
        except Exception as exc:  # noqa: BLE001 -- the health loop retries when it is back
            log.warning("server %s did not load version %d: %s", server.url, version, exc)
            server.healthy = False
        finally:
            server.pushing = False
        with self.lock:
            self.lock.notify_all()

    # ---- trainer side ------------------------------------------------------------------------------------
    def batch(self, step: int, committed: int, timeout: float) -> dict | None:
        """The batch of step `step` (trainer version `step`), or None if not ready within `timeout`."""
        deadline = time.monotonic() + timeout
        per_step = self.run.rl.training.prompts_per_step
        with self.lock:
            for old in [s for s in self.batches if s < committed]:
                del self.batches[old]
            if step in self.batches:
                return self.batches[step]
            if self.batches and step != max(self.batches) + 1:
                raise HttpError(409, f"step {step}: batches exist up to {max(self.batches)}; ask for the next one",
                                "step")
            self.trainer_version = max(self.trainer_version, step)
            self.lock.notify_all()
            while True:
                self._drop_stale(step)
                if len(self.buffered) >= per_step:
                    break
                left = deadline - time.monotonic()
                if left <= 0 or not self.running:
                    return None
                self.lock.wait(timeout=min(left, 0.5))
            # In prompt order, not arrival order: which rank trains which sample must not depend on timing.
            groups = sorted((self.buffered.popleft() for _ in range(per_step)), key=lambda g: g.prompt_index)
            self.consumed += per_step
            batch = self._make_batch(step, groups)
            self.batches[step] = batch
            self.lock.notify_all()
            return batch

    def _drop_stale(self, step: int) -> None:
        kept = deque()
        for g in self.buffered:
            if 0 <= step - g.version <= self.cfg.max_staleness:
                kept.append(g)
            else:
                self.counts["dropped_stale_groups"] += 1
                self.metrics[M.SAMPLES_DROPPED_STALE].inc(len(g.samples))
                self._event("dropped_stale", request_id=g.request_id, version=g.version, step=step)
        self.buffered = kept

    def _make_batch(self, step: int, groups: list[Group]) -> dict:
        rewards = torch.tensor([[s["reward"] for s in g.samples] for g in groups])
        advantages = grpo_advantages(rewards, scale_by_std=self.algo.scale_by_std)
        samples = []
        for g, adv in zip(groups, advantages.tolist()):
            for j, (s, a) in enumerate(zip(g.samples, adv)):
                samples.append({"id": f"{g.request_id}/{j}", "prompt_ids": g.prompt_ids, "version": g.version,
                                "advantage": a, **s})
        staleness = sum(step - g.version for g in groups) / len(groups)
        reward_mean = float(rewards.mean())
        self.metrics[M.REWARD_MEAN].set(reward_mean)
        self.metrics[M.SAMPLE_STALENESS].set(staleness)
        self._event("batched", step=step, request_ids=[g.request_id for g in groups])
        return {"step": step, "samples": samples,
                "stats": {"reward_mean": reward_mean, "staleness_mean": staleness,
                          "accuracy": float((rewards >= self.run.rl.reward.correct_weight).float().mean()),
                          **self.counts, "reward_failures": self.scorer.failures}}


def expand_endpoint(endpoint: str) -> list[str]:
    """`http://host:port` -> itself; `dns+http://name:port` -> `http://<address>:port` for each IPv4 address of
    `name` (Kubernetes pod addresses)."""
    if not endpoint.startswith("dns+"):
        return [endpoint.rstrip("/")]
    url = urllib.parse.urlparse(endpoint.removeprefix("dns+"))
    if url.hostname is None or url.port is None:
        raise ValueError(f"endpoint {endpoint!r}: expected dns+http://<name>:<port>")
    infos = socket.getaddrinfo(url.hostname, url.port, socket.AF_INET, socket.SOCK_STREAM)
    return sorted({f"{url.scheme}://{info[4][0]}:{url.port}" for info in infos})


def make_server(orch: Orchestrator, host: str, port: int) -> HttpServer:
    class Handler(JsonHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlparse(self.path)
            try:
                if url.path == "/health":
                    self.send_json(200, {"status": "ok", "published": orch.published, "servers": {
                        s.url: {"healthy": s.healthy, "version": s.version, "in_flight": s.in_flight}
                        for s in list(orch.servers.values())}})
                elif url.path == "/metrics":
                    self.send_bytes(200, orch.metrics.exposition(), "text/plain; version=0.0.4")
                elif url.path == "/v1/state":
                    self.send_json(200, orch.snapshot())
                elif url.path == "/v1/batch":
                    q = urllib.parse.parse_qs(url.query)
                    step, committed = _int_arg(q, "step"), _int_arg(q, "committed", 0)
                    batch = orch.batch(step, committed, BATCH_POLL_S)
                    self.send_json(200 if batch else 202, batch or {"ready": False, "step": step})
                else:
                    raise HttpError(404, f"no such path {url.path}")
            except HttpError as err:
                self.send_error_json(err)

        def do_POST(self) -> None:
            try:
                if self.path != "/v1/version":
                    raise HttpError(404, f"no such path {self.path}")
                body = self.read_json()
                version = body.get("version") if isinstance(body, dict) else None
                if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                    raise HttpError(400, f"version: {version!r}; expected a non-negative integer", "version")
                orch.publish(version)
                self.send_json(200, {"published": orch.published})
            except HttpError as err:
                self.send_error_json(err)

    return HttpServer((host, port), Handler)


def _int_arg(query: dict, name: str, default: int | None = None) -> int:
    values = query.get(name)
    if not values:
        if default is None:
            raise HttpError(400, f"query parameter {name} is required", name)
        return default
    try:
        return int(values[0])
    except ValueError:
        raise HttpError(400, f"{name}: {values[0]!r} is not an integer", name) from None


def resume_state(resume: str | None, out: Path) -> dict | None:
    """`--resume`: a path to orchestrator.json, or 'latest' for the one in the run's newest trainer checkpoint
    (None while there is no checkpoint yet: a fresh start)."""
    if resume == "latest":
        from . import checkpoint as ckpt

        newest = ckpt.latest(out / "checkpoints")
        resume = str(newest / "orchestrator.json") if newest else None
        log.info("resuming from %s", resume or "nothing: no checkpoint yet")
    return json.loads(Path(resume).read_text()) if resume else None


def main(argv: list[str]) -> int:
    parser = run_argparser("orchestrate", "drive rollouts and feed trainers for a run")
    parser.add_argument("--port", type=int, default=ORCHESTRATOR_PORT)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--endpoint", action="append", default=[],
                        help="rollout server base URL (repeatable; default: rl.orchestrator.endpoints)")
    parser.add_argument("--resume", help="orchestrator state: orchestrator.json of a trainer checkpoint, or 'latest' "
                                         "for the run's newest checkpoint (a fresh start when there is none)")
    args = parser.parse_args(argv)
    run = load(args.run)
    out = output_dir(run)
    out.mkdir(parents=True, exist_ok=True)
    state = resume_state(args.resume, out)
    orch = Orchestrator(run, args.endpoint or list(run.rl.orchestrator.endpoints),
                        os.environ.get(run.rl.weight_token_env), out / "orchestrator-events.jsonl", state)
    orch.start()
    server = make_server(orch, args.host, args.port)
    log.info("orchestrator on %s:%d over %d rollout servers", args.host, server.server_address[1], len(orch.servers))
    try:
        server.serve_forever()
    finally:
        orch.stop()
    return 0
