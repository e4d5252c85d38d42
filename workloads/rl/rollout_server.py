"""Rollout server: an OpenAI-style completions endpoint around our MoE model, with dynamic batching.

  POST /v1/completions  {"prompt": str | [token ids], "n", "max_tokens", "temperature", "top_p", "seed",
                         "logprobs", "return_routing", "model"}; answers carry `weight_version`, per-token
                         logprobs and (on request) the routed expert ids for routing replay
  GET  /v1/models, /health, /metrics (Prometheus)
  POST /v1/weights/load {"version": n}  (Authorization: Bearer <token>) loads a published version; the swap
                         happens between batches, so no completion mixes two versions

Concurrent requests queue up; one worker thread takes as many as fit in `rollout.max_batch_size` rows and decodes
them together. Malformed requests get a 4xx with a JSON error naming the field, and the server keeps serving.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_rl_eks.core import metrics as M
from moe_rl_eks.core.cluster import ROLLOUT_PORT
from moe_rl_eks.core.run import RunConfig

from .engine import RolloutEngine, RowOutput, RowRequest, SamplingParams
from .generation import Row
from .replica import Replica, follow
from .runtime import HttpError, JsonHandler, HttpServer, load, output_dir, run_argparser
from .tokenizer import Tokenizer, UnknownText, load_tokenizer
from .weights import WeightStore, open_store

log = logging.getLogger(__name__)
COMPLETION_FIELDS = {"model", "prompt", "n", "max_tokens", "temperature", "top_p", "seed", "logprobs",
                     "return_routing", "logprob_mode"}  # logprob_mode: accepted for the orchestrator until the FastAPI server (issue 13) replaces this one


@dataclass
class Work:
    rows: list[Row]
    done: Future


@dataclass
class Control:
    """A replica operation for the batcher to run between batches (only it talks to the replica)."""
    op: str
    args: tuple
    done: Future


def take_batch(first: Work, waiting: queue.Queue, max_rows: int) -> tuple[list[Work], Any]:
    """Dynamic batching: `first` plus whatever requests are already waiting, up to `max_rows` rows. Returns the
    batch and the item that ended it (a request that does not fit, a replica operation such as a weight swap, or
    the stop signal), if any; a weight swap is never overtaken, so no completion mixes two versions."""
    batch, rows = [first], len(first.rows)
    while rows < max_rows:
        try:
            nxt = waiting.get_nowait()
        except queue.Empty:
            return batch, None
        if not isinstance(nxt, Work) or rows + len(nxt.rows) > max_rows:
            return batch, nxt
        batch.append(nxt)
        rows += len(nxt.rows)
    return batch, None


def parse_completion_request(body: Any, run: RunConfig, tokenizer: Tokenizer) -> tuple[list[RowRequest], dict]:
    """Validate an OpenAI-style completion request -> rows to generate (n per prompt) and echo options."""
    s = run.rl.sampling
    if not isinstance(body, dict):
        raise HttpError(400, "expected a JSON object")
    unknown = sorted(set(body) - COMPLETION_FIELDS)
    if unknown:
        raise HttpError(400, f"unknown field {unknown[0]!r}; supported: {', '.join(sorted(COMPLETION_FIELDS))}",
                        unknown[0])

    def typed(name: str, kinds: tuple, default: Any) -> Any:
        value = body.get(name, default)
        if value is not None and (isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds)):
            raise HttpError(400, f"{name}: {value!r} has the wrong type; expected {'/'.join(k.__name__ for k in kinds)}", name)
        return value

    prompt = body.get("prompt")
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(prompt)
        except UnknownText as exc:
            raise HttpError(400, f"prompt: {exc}", "prompt") from None
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
        bad = [t for t in ids if not 0 <= t < run.model.vocab_size]
        if bad:
            raise HttpError(400, f"prompt: token id {bad[0]} is outside [0, {run.model.vocab_size})", "prompt")
    else:
        raise HttpError(400, "prompt: expected a non-empty string or a non-empty list of token ids", "prompt")
    if not ids or len(ids) > s.max_prompt_tokens:
        raise HttpError(400, f"prompt: {len(ids)} tokens; allowed 1..{s.max_prompt_tokens}", "prompt")
    n = typed("n", (int,), 1)
    if not 1 <= n <= s.max_n:
        raise HttpError(400, f"n: {n} is outside 1..{s.max_n}", "n")
    max_tokens = typed("max_tokens", (int,), min(16, run.rollout.max_new_tokens))  # OpenAI's default: 16
    if not 1 <= max_tokens <= run.rollout.max_new_tokens:
        raise HttpError(400, f"max_tokens: {max_tokens} is outside 1..{run.rollout.max_new_tokens}", "max_tokens")
    if len(ids) + max_tokens > run.model.max_position_embeddings:
        raise HttpError(400, f"prompt + max_tokens = {len(ids) + max_tokens} exceeds the model's "
                             f"{run.model.max_position_embeddings} positions", "max_tokens")
    temperature = float(typed("temperature", (int, float), 1.0))
    if not 0 <= temperature <= 10:
        raise HttpError(400, f"temperature: {temperature} is outside [0, 10]", "temperature")
    top_p = float(typed("top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise HttpError(400, f"top_p: {top_p} is outside (0, 1]", "top_p")
    seed = typed("seed", (int,), None)
    if seed is not None and not 0 <= seed < 2**63:
        raise HttpError(400, f"seed: {seed} is outside [0, 2**63)", "seed")
    logprobs = typed("logprobs", (int,), None)
    if logprobs is not None and logprobs not in (0, 1):
        raise HttpError(400, f"logprobs: {logprobs}; only the sampled token's logprob is returned (0 or 1)", "logprobs")
    routing = typed("return_routing", (bool,), False)
    typed("model", (str,), None)
    try:
        params = SamplingParams(max_tokens, temperature, top_p, seed=seed, return_routing=routing)
    except ValueError as exc:
        raise HttpError(400, str(exc), str(exc).split(":")[0]) from None
    # Choice i samples from the counter (seed, i, step): a retried request reproduces its completions anywhere.
    request_id = f"cmpl-{uuid.uuid4().hex[:16]}"
    rows = [RowRequest(tuple(ids), params, request_id, i) for i in range(n)]
    return rows, {"logprobs": logprobs is not None, "prompt_tokens": len(ids)}


def completion_response(run: RunConfig, tokenizer: Tokenizer, version: int, results: list[RowOutput],
                        options: dict) -> dict:
    choices = []
    for i, r in enumerate(results):
        finished = r.finish_reason == "stop"
        text_ids = r.token_ids[:-1] if finished else r.token_ids
        choice = {"index": i, "text": tokenizer.decode(text_ids), "token_ids": r.token_ids,
                  "finish_reason": r.finish_reason}
        if options["logprobs"]:
            choice["logprobs"] = {"tokens": [tokenizer.decode([t]) for t in r.token_ids],
                                  "token_logprobs": r.logprobs}
        if r.routing is not None:  # per layer, per fed position, the expert ids (the orchestrator's layout today)
            choice["routed_experts"] = r.routing.transpose(1, 0, 2).tolist()
        choices.append(choice)
    completion_tokens = sum(len(r.token_ids) for r in results)
    return {"id": results[0].request_id, "object": "text_completion", "created": int(time.time()),
            "model": run.name, "weight_version": version, "choices": choices,
            "usage": {"prompt_tokens": options["prompt_tokens"], "completion_tokens": completion_tokens,
                      "total_tokens": options["prompt_tokens"] * len(results) + completion_tokens}}


def make_server(run: RunConfig, engine: RolloutEngine, host: str, port: int, token: str | None
                ) -> HttpServer:
    tokenizer = engine.tokenizer

    class Handler(JsonHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                ok = engine.version is not None
                self.send_json(200 if ok else 503, {
                    "status": "ok" if ok else "loading", "weight_version": engine.version,
                    "busy_seconds": engine.busy_seconds, "uptime_seconds": time.monotonic() - engine.started})
            elif self.path == "/metrics":
                self.send_bytes(200, engine.metrics.exposition(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                self.send_json(200, {"object": "list", "data": [
                    {"id": run.name, "object": "model", "owned_by": "moe-rl-eks", "weight_version": engine.version}]})
            else:
                self.send_error_json(HttpError(404, f"no such path {self.path}"))

        def do_POST(self) -> None:
            try:
                if self.path == "/v1/completions":
                    rows, options = parse_completion_request(self.read_json(), run, tokenizer)
                    try:
                        results = engine.submit(rows).result()
                    except RuntimeError as exc:  # no weights yet, or stopping
                        raise HttpError(503, str(exc)) from None
                    failed = [r.error for r in results if r.finish_reason == "error"]
                    if failed:
                        raise HttpError(400, failed[0])
                    engine.metrics[M.ROLLOUT_REQUESTS].inc()
                    self.send_json(200, completion_response(run, tokenizer, results[0].weight_version, results,
                                                            options))
                elif self.path == "/v1/weights/load":
                    self._load_weights()
                else:
                    raise HttpError(404, f"no such path {self.path}")
            except HttpError as err:
                self.send_error_json(err)
            except Exception as exc:  # noqa: BLE001 -- answer, log, keep serving
                log.exception("request failed")
                self.send_json(500, {"error": {"message": str(exc), "type": "server_error", "param": None}})

        def _load_weights(self) -> None:
            given = self.headers.get("Authorization", "")
            if not token or not secrets.compare_digest(given, f"Bearer {token}"):
                raise HttpError(401, "weight loading needs 'Authorization: Bearer <token>'")
            body = self.read_json()
            version = body.get("version") if isinstance(body, dict) else None
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise HttpError(400, f"version: {version!r}; expected a non-negative integer", "version")
            try:
                seconds = engine.load_version(version)
            except Exception as exc:  # noqa: BLE001 -- a bad version must not take the server down
                raise HttpError(409, f"version {version} could not be loaded: {exc}", "version") from None
            self.send_json(200, {"weight_version": engine.version, "load_seconds": seconds})

    return HttpServer((host, port), Handler)


def main(argv: list[str]) -> int:
    parser = run_argparser("serve-rollout", "serve completions for a run")
    parser.add_argument("--port", type=int, default=ROLLOUT_PORT)
    parser.add_argument("--host", default="0.0.0.0")
    args = parser.parse_args(argv)
    run = load(args.run)
    torch.set_num_threads(1)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes != run.rollout.gpus_per_server:
        raise SystemExit(f"rollout.gpus_per_server is {run.rollout.gpus_per_server} but this server has {processes} "
                         "process(es); start one per GPU with torchrun (moe_rl_eks.core.cli.launch)")
    replica = Replica.sharded(run) if processes > 1 else Replica(run)
    if replica.rank > 0:  # the HTTP server and the batcher live on rank 0; this rank follows its operations
        follow(replica)
        return 0
    out = output_dir(run)
    store = open_store(run.rl.weights, out / "weights")
    # Downloads go to the pod's own scratch space: the run's output directory is read-only for rollout pods.
    cache = Path(tempfile.mkdtemp(prefix="moerl-rollout-cache-"))
    engine = RolloutEngine(run, store, cache, load_tokenizer(run.rl.sampling.tokenizer), replica)
    # Serve /health at once (503 until weights arrive), and pick up the newest published version by itself.
    server = make_server(run, engine, args.host, args.port, os.environ.get(run.rl.weight_token_env))
    threading.Thread(target=_load_first_version, args=(engine, store), daemon=True).start()
    log.info("rollout server on %s:%d", args.host, server.server_address[1])
    try:
        server.serve_forever()
    finally:
        engine.stop()
    return 0


def _load_first_version(engine: RolloutEngine, store: WeightStore) -> None:
    while engine.version is None:
        latest = store.latest()
        if latest is not None:
            try:
                engine.load_version(latest.version)  # store.latest() is a VersionRef (lineage, version)
            except Exception as exc:  # noqa: BLE001 -- pruned meanwhile: try the newer one
                log.warning("loading version %s failed: %s", latest, exc)
        time.sleep(0.2)
