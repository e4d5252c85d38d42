"""What every RL role shares: the run file, the model built from it, JSON over HTTP (FastAPI apps served by uvicorn,
errors in OpenAI's shape), Prometheus registries."""
from __future__ import annotations

import argparse
import asyncio
import bisect
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from moe_rl_eks.core.metrics import Metric
from moe_rl_eks.core.run import RunConfig, load_run

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20


def read_jsonl(path: Path) -> list[dict]:
    """The records a role appends to `path`, one JSON object a line (none before the file exists), up to its last
    complete line: a reader beside the writer (local-run's progress, a test waiting for a step) may find the last
    record half-written, since a long line is more than one write."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def run_argparser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"moerl {prog}", description=description)
    parser.add_argument("--run", required=True, help="run configuration (configs/runs/<name>.yaml)")
    return parser


def output_dir(run: RunConfig) -> Path:
    return Path(run.rl.training.output_directory(run.name))


def load(path: str) -> RunConfig:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return load_run(path)


class CountedHistogram:
    """A Prometheus histogram (no labels) whose `observe` takes a count: the rollout engine observes one
    inter-token latency for all the rows of a decode step in one call, not one call per token. Exposed exactly as
    the client library's Histogram (`_bucket`, `_count`, `_sum`, `_created`)."""

    def __init__(self, metric: Metric, registry: CollectorRegistry) -> None:
        if metric.labels:
            raise ValueError(f"{metric.name}: labels {metric.labels} on a histogram; histograms here take none")
        self.metric = metric
        self.bounds = [*metric.buckets, float("inf")]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.created = time.time()
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        at = bisect.bisect_left(self.bounds, value)  # the first bucket whose upper bound (le) holds the value
        with self._lock:
            self.counts[at] += count
            self.sum += value * count

    def collect(self):
        with self._lock:
            counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.metric.name, self.metric.help, buckets=buckets, sum_value=total)
        yield GaugeMetricFamily(f"{self.metric.name}_created", self.metric.help, value=self.created)


class Registry:
    """One Prometheus registry per role, so several roles (and tests) can live in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._made: dict[str, Any] = {}

    def __getitem__(self, metric: Metric):
        if metric.name not in self._made:
            if metric.kind == "histogram":
                made = CountedHistogram(metric, self.registry)
            elif metric.kind == "counter":  # the client library appends _total itself
                made = Counter(metric.name.removesuffix("_total"), metric.help, metric.labels, registry=self.registry)
            else:
                made = Gauge(metric.name, metric.help, metric.labels, registry=self.registry)
            self._made[metric.name] = made
        return self._made[metric.name]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# OpenAI's error types by status (its API and vLLM's answer {"error": {"message", "type", "param", "code"}}).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
               500: "server_error", 503: "service_unavailable_error"}


@dataclass
class HttpError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def json_api(title: str, description: str, lifespan: Any = None) -> "FastAPI":
    """A FastAPI app whose every error is OpenAI's shape: HttpError as raised, schema violations as 400 naming the
    field (FastAPI's default is 422 without a `param`), unknown paths and methods as 404/405, a body over
    MAX_BODY_BYTES as 413, and any other exception as a logged 500 that keeps the server serving."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title=title, description=description, version="1", lifespan=lifespan)

    def answer(err: HttpError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HttpError)
    async def _http_error(_: Request, err: HttpError) -> JSONResponse:
        return answer(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _starlette(_: Request, exc: HTTPException) -> JSONResponse:
        return answer(HttpError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return answer(HttpError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))

    app.add_middleware(BodyLimit)
    return app


class BodyLimit:
    """Refuses a body over MAX_BODY_BYTES with a 413: from its Content-Length before reading it, or (a chunked
    upload, whose length is unknown) once the bytes read pass the limit; such a body is read here and handed on
    whole. Plain ASGI (not starlette's BaseHTTPMiddleware, which relays every response through a memory stream and
    delayed the disconnect a streamed answer listens for)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if b"content-length" in headers:  # the HTTP parser checked it is a number
            if int(headers[b"content-length"]) > MAX_BODY_BYTES:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY_BYTES:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body"):
                break
        whole = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return whole.pop() if whole else await receive()
        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope, receive, send) -> None:
        from fastapi.responses import JSONResponse

        err = HttpError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", None, "body_too_large")
        await JSONResponse(err.body(), status_code=413)(scope, receive, send)


def validation_error(errors: list[dict]) -> HttpError:
    """pydantic's errors -> one 400 naming the top-level field (OpenAI's `param`), the value and what is allowed.
    A field that failed every branch of a union (e.g. `prompt`) lists what each branch expected."""
    located = [(e, [str(p) for p in e["loc"] if p != "body"]) for e in errors]
    first, path = located[0]
    if not path or first["type"] in ("json_invalid", "model_attributes_type", "dict_type"):
        detail = first["msg"] if first["type"] == "json_invalid" else "expected a JSON object"
        return HttpError(400, f"body: {detail}", code="invalid_body")
    field = path[0]
    reasons = list(dict.fromkeys(e["msg"] for e, p in located if p[:1] == [field]))
    value = "missing" if first["type"] == "missing" else f"got {_short(first.get('input'))}"
    return HttpError(400, f"{field}: {'; or '.join(reasons)} ({value})", field, first["type"])


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class BackgroundServer:
    """A FastAPI app served by uvicorn from a thread, on a socket bound before it starts (port 0 = any free
    port), so the caller knows the URL at once: for tests and for roles that embed a server."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        # IPPROTO_TCP explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP, and
        # accepted sockets inherit the listener's; with proto 0, every keep-alive answer waits ~40 ms for an ACK.
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                    socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app))
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.socket]))

    def start(self) -> "BackgroundServer":
        self.thread.start()
        wait_for(f"{self.url}/openapi.json", timeout=30, interval=0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


def uvicorn_config(app: Any, **kwargs: Any):
    import uvicorn

    # One event loop per process; the engine's thread hands it tokens. The backlog absorbs an orchestrator
    # opening hundreds of connections at once.
    return uvicorn.Config(app, log_level="warning", access_log=False, backlog=2048, timeout_keep_alive=30, **kwargs)


def serve(app: Any, host: str, port: int) -> None:
    """Serve `app` in this thread until SIGTERM/SIGINT (uvicorn then lets requests in flight finish)."""
    import uvicorn

    uvicorn.Server(uvicorn_config(app, host=host, port=port)).run()


# What a request raises when its peer is unreachable, or dies or restarts while it answers (a body cut short:
# http.client.IncompleteRead): callers that wait a peer out retry these. An HTTP error status (urllib.error.HTTPError,
# a URLError too) is an answer: callers look at it first.
TRANSIENT_HTTP_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException)


def http_json(method: str, url: str, body: Any = None, *, timeout: float, token: str | None = None) -> Any:
    """One JSON request; raises urllib.error.HTTPError on an error status, else one of TRANSIENT_HTTP_ERRORS on
    failure."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def wait_for(url: str, *, timeout: float, interval: float = 0.2) -> Any:
    """Poll a JSON GET endpoint until it answers 200 (a starting role), or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return http_json("GET", url, timeout=2)
        except (*TRANSIENT_HTTP_ERRORS, json.JSONDecodeError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout:.0f} s") from None
            time.sleep(interval)


def cap_gpu_memory(run: RunConfig, role: str) -> float | None:
    """In a local GPU run (`local_gpus`), cap this process's CUDA allocator at its role's memory share of each
    GPU it sees, so that roles sharing a GPU cannot take each other's memory: an allocation past the share fails
    in this process instead of in its neighbour. Returns the share (None: no cap, the role has its GPUs alone)."""
    if run.local_gpus is None:
        return None
    import torch

    share = getattr(run.local_gpus, role).memory_share
    if torch.cuda.is_available():
        for device in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(share, device)
    return share
