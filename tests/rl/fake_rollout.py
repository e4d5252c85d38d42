"""Lightweight HTTP endpoints on 127.0.0.1 that answer like rollout servers (completions with token ids and
logprobs, weight loads, /ready), for testing the orchestrator: many of them share one aiohttp event loop in a
background thread. Each knows the weights it holds and counts what it saw, and can be told to misbehave."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Endpoint:
    delay_s: float = 0.0  # before answering a completion
    first_delays: list = field(default_factory=list)  # the first completions wait these instead, one each
    row_tokens_per_s: float | None = None  # the per-row decode rate /ready reports
    seeds: list = field(default_factory=list)  # every completion request's seed, in arrival order
    status: int = 200  # answer completions with this status (a 4xx/5xx body otherwise)
    holds: tuple[int, int] | None = (0, 0)  # (lineage, version)
    lag: int = 0  # after a load, this many completions still come from the previous weights (a swap in progress)
    previous: tuple[int, int] | None = None
    completions: int = 0
    cancelled: int = 0  # completions whose client went away before the answer
    in_flight: int = 0
    peak_in_flight: int = 0
    loads: list = field(default_factory=list)
    loads_held: bool = False  # weight loads do not answer (or take effect) while this is set: a slow load
    url: str = ""


class FakeRollouts:
    """`wave`: completions are held until this many are in flight across all endpoints (or `delay_s` passed),
    then all answer: the whole wave is provably concurrent, whatever the machine's speed."""

    def __init__(self, count: int, wave: int | None = None, **defaults) -> None:
        self.endpoints = [Endpoint(**defaults) for _ in range(count)]
        self.wave, self.in_flight, self.peak = wave, 0, 0
        self.loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=60)

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    async def _start(self) -> None:
        self.wave_full = asyncio.Event()
        for e in self.endpoints:
            app = web.Application()
            app.add_routes([web.post("/v1/completions", self._complete(e, self)), web.get("/ready", self._ready(e)),
                            web.get("/health", self._ready(e)), web.post("/v1/weights/load", self._load(e))])
            runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            e.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            self._runners.append(runner)

    @staticmethod
    def _ready(e: Endpoint):
        async def handler(request: web.Request) -> web.Response:
            if e.holds is None:
                return web.json_response({"status": "loading"}, status=503)
            return web.json_response({"ready": True, "weight_lineage": e.holds[0], "weight_version": e.holds[1],
                                      "row_tokens_per_s": e.row_tokens_per_s})
        return handler

    @staticmethod
    def _load(e: Endpoint):
        async def handler(request: web.Request) -> web.Response:
            body = await request.json()
            while e.loads_held:
                await asyncio.sleep(0.01)
            e.loads.append((body.get("lineage", 0), body["version"]))
            e.previous, e.holds = e.holds, (body.get("lineage", 0), body["version"])
            return web.json_response({"weight_version": e.holds[1], "weight_lineage": e.holds[0], "load_seconds": 0.0})
        return handler

    @staticmethod
    def _complete(e: Endpoint, all_: "FakeRollouts"):
        async def handler(request: web.Request) -> web.Response:
            body = await request.json()
            e.seeds.append(body["seed"])
            delay = e.first_delays.pop(0) if e.first_delays else e.delay_s
            e.in_flight += 1
            all_.in_flight += 1
            e.peak_in_flight = max(e.peak_in_flight, e.in_flight)
            all_.peak = max(all_.peak, all_.in_flight)
            holds = e.holds  # the version every token is sampled with
            if e.lag > 0 and e.previous is not None:
                e.lag -= 1
                holds = e.previous
            try:
                if all_.wave is None:
                    await asyncio.sleep(delay)
                else:
                    if all_.in_flight >= all_.wave:
                        all_.wave_full.set()
                    await asyncio.wait_for(all_.wave_full.wait(), timeout=e.delay_s)
            except asyncio.CancelledError:  # aiohttp cancels the handler when the client closes the connection
                e.cancelled += 1
                raise
            finally:
                e.in_flight -= 1
                all_.in_flight -= 1
                if all_.in_flight == 0:
                    all_.wave_full.clear()  # the next wave is held again
            if e.status != 200:
                return web.json_response({"error": {"message": "refused", "type": "invalid_request_error"}},
                                         status=e.status)
            e.completions += 1
            seed = body["seed"]
            choices = []
            for i in range(body["n"]):
                digit = (seed + i) % 3  # the answer varies within a group, so rewards do too
                tokens = [ord(str(digit)), 2]
                choices.append({"index": i, "text": str(digit), "token_ids": tokens, "finish_reason": "stop",
                                "logprobs": {"tokens": [], "token_logprobs": [-0.5, -0.1], "top_logprobs": None,
                                             "text_offset": []}, "routing_ref": None,
                                "weight_versions": [{"version": holds[1], "lineage": holds[0], "tokens": 2}]})
            return web.json_response({"id": "cmpl", "object": "text_completion", "created": 0, "model": body.get("model") or "policy",
                                      "weight_version": holds[1], "weight_lineage": holds[0], "choices": choices})
        return handler

    def close(self) -> None:
        async def stop():
            for runner in self._runners:
                await runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def serve(count: int, conn, **options) -> None:
    """Child-process entry: serve `count` endpoints, send their URLs, then answer 'stats' with the peak of
    concurrent completions and each endpoint's (completions, peak in flight, cancelled) until told 'stop'."""
    fakes = FakeRollouts(count, **options)
    conn.send(fakes.urls)
    while conn.recv() != "stop":
        conn.send((fakes.peak, [(e.completions, e.peak_in_flight, e.cancelled) for e in fakes.endpoints]))
    fakes.close()
    conn.send("stopped")
