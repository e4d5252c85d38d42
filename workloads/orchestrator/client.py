"""The rollout client: what the orchestrator asks of a rollout server (completions, weight push, health) behind
one small interface, `RolloutBackend`, and its HTTP implementation on aiohttp: asynchronous, keep-alive pooled
connections, no thread per request.

Errors say whose fault they were: `ServerFault` (connection refused or reset, 5xx, a malformed answer: the server
is suspect), `RequestFault` (a 4xx: this request is wrong everywhere, the server is fine) or `DeadlineMissed` (no
answer in time: for a completion, a long row on a busy server; the caller decides). Cancelling a call closes its
connection, which is how a rollout server learns to cancel the rows (hedge losers, deadlines).
"""
from __future__ import annotations

import asyncio
import json
from typing import Protocol

import aiohttp
from pydantic import ValidationError

from ..rl.openai_api import CompletionRequest, Health, Readiness, read_completion
from ..rl.protocol import Completion, ProtocolError, VersionRef


class RolloutFault(Exception):
    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class ServerFault(RolloutFault):
    """The server failed (down, overloaded, hung, or answered garbage)."""


class RequestFault(RolloutFault):
    """The server refused this request (4xx); another server would too."""


class DeadlineMissed(RolloutFault):
    """No answer within the call's deadline. For a completion that is not the server's fault: a healthy server
    decoding a long row at its batch's rate may take that long (core/deadlines.py)."""


NOT_READY = Readiness(ready=False, weight_version=None, weight_lineage=None)


class RolloutBackend(Protocol):
    async def complete(self, url: str, request: CompletionRequest, *, timeout_s: float,
                       sent: asyncio.Event | None = None) -> Completion:
        """One completion request; sets `sent` once the request has gone out (the straggler clock's start)."""

    async def load_weights(self, url: str, ref: VersionRef, *, timeout_s: float) -> None:
        """Ask the server to load `ref`; returns once it serves it."""

    async def health(self, url: str, *, timeout_s: float) -> Readiness:
        """Liveness and readiness: what the server serves (weight_lineage None where it names none) and its per-row
        decode rate; raises a RolloutFault when the server does not answer."""

    async def close(self) -> None: ...


class HttpRolloutBackend:
    """RolloutBackend over HTTP/1.1 keep-alive connections (one pool for every server, no limit of its own:
    the orchestrator's per-server in-flight cap bounds the connections, so no request waits here for a
    connection and every request is sent as soon as it is issued)."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created on the event loop that uses it
            trace = aiohttp.TraceConfig()

            async def headers_sent(session, ctx, params) -> None:
                if ctx.trace_request_ctx is not None:
                    ctx.trace_request_ctx.set()

            trace.on_request_headers_sent.append(headers_sent)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
                trace_configs=[trace], json_serialize=json.dumps)
        return self._session

    async def _call(self, method: str, url: str, body: dict | None, timeout_s: float,
                    sent: asyncio.Event | None = None, auth: bool = False) -> tuple[int, object]:
        headers = {"Authorization": f"Bearer {self.token}"} if auth and self.token else None
        try:
            async with self._client().request(method, url, json=body, headers=headers, trace_request_ctx=sent,
                                              timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                text = await resp.text()
                status = resp.status
        except asyncio.TimeoutError:
            raise DeadlineMissed(url, f"no answer within {timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            raise ServerFault(url, f"{type(exc).__name__}: {exc}") from None
        try:
            return status, json.loads(text) if text else None
        except json.JSONDecodeError:
            if status < 400:
                raise ServerFault(url, f"{status} answer is not JSON: {text[:200]!r}") from None
            return status, text

    @staticmethod
    def _raise_for(url: str, status: int, body: object) -> None:
        if status < 400:
            return
        detail = body.get("error", body) if isinstance(body, dict) else body
        message = f"{status}: {str(detail)[:300]}"
        raise (RequestFault if 400 <= status < 500 else ServerFault)(url, message)

    async def complete(self, url: str, request: CompletionRequest, *, timeout_s: float,
                       sent: asyncio.Event | None = None) -> Completion:
        status, body = await self._call("POST", f"{url}/v1/completions", request.to_json(), timeout_s, sent)
        self._raise_for(url, status, body)
        try:
            completion = read_completion(body)
        except ProtocolError as exc:
            raise ServerFault(url, f"malformed completion: {exc}") from None
        if len(completion.choices) != request.n:
            raise ServerFault(url, f"{len(completion.choices)} choices for n = {request.n}")
        return completion

    async def load_weights(self, url: str, ref: VersionRef, *, timeout_s: float) -> None:
        status, body = await self._call("POST", f"{url}/v1/weights/load", ref.to_json(), timeout_s, auth=True)
        self._raise_for(url, status, body)

    async def health(self, url: str, *, timeout_s: float) -> Readiness:
        status, body = await self._call("GET", f"{url}/ready", None, timeout_s)
        if status == 404:  # a server from before /ready: its /health carries the version, no lineage
            status, body = await self._call("GET", f"{url}/health", None, timeout_s)
            if status == 200:
                try:
                    return Readiness(ready=True, weight_version=Health.model_validate(body).weight_version,
                                     weight_lineage=None)
                except ValidationError:
                    return NOT_READY
        if status == 503:
            return NOT_READY
        self._raise_for(url, status, body)
        try:
            return Readiness.model_validate(body)
        except ValidationError:  # an answer we cannot read names no version to send work to
            return NOT_READY

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

