"""What every RL role shares: the run file, the model built from it, JSON over HTTP, Prometheus registries."""
from __future__ import annotations

import argparse
import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from moe_rl_eks.core.metrics import Metric
from moe_rl_eks.core.run import RunConfig, load_run

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 << 20


def run_argparser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"moerl {prog}", description=description)
    parser.add_argument("--run", required=True, help="run configuration (configs/runs/<name>.yaml)")
    return parser


def output_dir(run: RunConfig) -> Path:
    return Path(run.rl.training.output_dir.format(name=run.name))


def load(path: str) -> RunConfig:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return load_run(path)


class Registry:
    """One Prometheus registry per role, so several roles (and tests) can live in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._made: dict[str, Any] = {}

    def __getitem__(self, metric: Metric):
        if metric.name not in self._made:
            cls = Counter if metric.kind == "counter" else Gauge
            name = metric.name.removesuffix("_total") if metric.kind == "counter" else metric.name
            self._made[metric.name] = cls(name, metric.help, registry=self.registry)
        return self._made[metric.name]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class HttpError(Exception):
    status: int
    message: str
    param: str | None = None


class JsonHandler(BaseHTTPRequestHandler):
    """Small JSON request/response helpers; handlers raise HttpError for 4xx answers."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_bytes(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, err: HttpError) -> None:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(err.status, "invalid_request_error")
        self.send_json(err.status, {"error": {"message": err.message, "type": kind, "param": err.param}})

    def read_json(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise HttpError(400, "Content-Length is not an integer") from None
        if length > MAX_BODY_BYTES:
            # Drain nothing: the connection is closed after answering, so the client's body is discarded.
            self.close_connection = True
            raise HttpError(413, f"request body of {length} bytes exceeds {MAX_BODY_BYTES}")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"body is not valid JSON: {exc}") from None


class HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    # The default backlog of 5 resets connections when an orchestrator opens dozens at once.
    request_queue_size = 256


def http_json(method: str, url: str, body: Any = None, *, timeout: float, token: str | None = None) -> Any:
    """One JSON request; raises urllib.error.URLError/HTTPError or TimeoutError on failure."""
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
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout:.0f} s") from None
            time.sleep(interval)
