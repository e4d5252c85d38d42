"""The rollout server pool: which servers exist (discovery), which are healthy and what they hold (health), which
need the published weights (weight push), and where the next request goes (choice).

Locking rule: every read or write of a server's fields holds `ServerPool.lock`, which is never held across I/O
or an await (callers take a decision under it, then do the I/O outside).
"""
from __future__ import annotations

import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from ..rl.protocol import VersionRef


@dataclass
class Server:
    url: str
    healthy: bool = False  # answered its last health check (or nothing failed on it since)
    holds: VersionRef | None = None  # the weights it serves
    in_flight: int = 0  # our requests it is working on
    pushing: VersionRef | None = None  # a weight load we asked for, not answered yet
    last_sent: float = 0.0  # monotonic time of the last request sent here
    row_tokens_per_s: float | None = None  # its per-row decode rate at its last health check (None: not reported)


@dataclass(frozen=True)
class ServerView:
    """A server's fields at one moment (what /health and tests read)."""

    url: str
    healthy: bool
    holds: VersionRef | None
    in_flight: int


class ServerPool:
    def __init__(self, endpoints: list[str], max_in_flight: int) -> None:
        if not endpoints:
            raise ValueError("rl.orchestrator.endpoints: no rollout endpoints; list at least one base URL")
        self.endpoints, self.max_in_flight = list(endpoints), max_in_flight
        self.lock = threading.Lock()
        self._servers: dict[str, Server] = {}
        self.discover()

    # ---- discovery and health -------------------------------------------------------------------------------
    def discover(self) -> None:
        """(Re)resolve the endpoints: a `dns+` endpoint stands for every address its name resolves to (a
        headless Service lists each ready rollout pod), so servers the autoscaler adds or removes are followed.
        A name that does not resolve now keeps the servers it had."""
        urls, failed = set(), []
        for endpoint in self.endpoints:
            try:
                urls.update(expand_endpoint(endpoint))
            except OSError:
                failed.append(endpoint)
        with self.lock:
            for url in urls - set(self._servers):
                self._servers[url] = Server(url)
            if not failed:
                for url in set(self._servers) - urls:
                    del self._servers[url]  # its requests still running finish or fail over as usual

    def urls(self) -> list[str]:
        with self.lock:
            return list(self._servers)

    def healthy(self, url: str, version: int | None, lineage: int | None,
                row_tokens_per_s: float | None = None) -> None:
        """A health check answered: the server is up and serves `version` (None: no weights loaded yet) of
        `lineage` (None: it does not report lineages, as an engine that only knows numbers: then the lineage we
        last loaded into it, if the numbers agree, else unknown, which makes it a server to push to), decoding
        each row at `row_tokens_per_s` (None: not reported, or nothing decoded yet)."""
        with self.lock:
            if (server := self._servers.get(url)) is not None:
                server.healthy = True
                server.holds = self._ref(server, version, lineage)
                server.row_tokens_per_s = row_tokens_per_s

    def row_rate(self, url: str) -> float | None:
        """The per-row decode rate `url` last reported (None: unknown)."""
        with self.lock:
            server = self._servers.get(url)
            return server.row_tokens_per_s if server is not None else None

    @staticmethod
    def _ref(server: Server, version: int | None, lineage: int | None) -> VersionRef | None:
        if version is None:
            return None
        if lineage is not None:
            return VersionRef(lineage, version)
        return server.holds if server.holds is not None and server.holds.version == version else None

    def attribute(self, url: str, version: VersionRef) -> VersionRef | None:
        """The version of an answer from a server that named no lineage (see `healthy`); None if unknown."""
        with self.lock:
            server = self._servers.get(url)
            return None if server is None else self._ref(server, version.version, None)

    def unhealthy(self, url: str) -> None:
        """It did not answer, or failed a request as a server does (connection, 5xx, deadline): no requests go
        there until a health check answers again."""
        with self.lock:
            if (server := self._servers.get(url)) is not None:
                server.healthy = False

    # ---- weight push ----------------------------------------------------------------------------------------
    def needing(self, target: VersionRef) -> list[str]:
        """Healthy servers that do not hold `target` and are not loading it; marked as loading it now (one load
        at a time per server; a newer target is sent once the current load answers)."""
        with self.lock:
            found = [s for s in self._servers.values()
                     if s.healthy and s.holds != target and s.pushing is None]
            for s in found:
                s.pushing = target
            return [s.url for s in found]

    def pushed(self, url: str, ref: VersionRef, loaded: bool) -> None:
        """The answer to a weight push of `ref` (loaded, or refused/failed: it is retried by the next health
        check's `needing`)."""
        with self.lock:
            if (server := self._servers.get(url)) is not None:
                server.pushing = None
                if loaded:
                    server.holds = ref

    # ---- choice ---------------------------------------------------------------------------------------------
    def acquire(self, usable: Callable[[VersionRef], bool], *, demand: int = 0,
                exclude: tuple[str, ...] = ()) -> str | None:
        """Where a new request goes, counted in flight there (the caller must `release` it): the least busy
        healthy server whose weights are `usable` (within the staleness bound: GroupBuffer.usable), the newest
        weights among equals, unless it already holds its fair share of `demand` (the requests that want a server
        now, including this one, plus those in flight) over every healthy server. A server still loading a version
        is healthy but may not be usable yet: without the share, the burst issued when a version is published
        would pile onto whichever server loaded it first while the rest of the pool idles."""
        with self.lock:
            healthy = [s for s in self._servers.values() if s.healthy]
            ready = [s for s in healthy if s.holds is not None and usable(s.holds)
                     and s.in_flight < self.max_in_flight and s.url not in exclude]
            if not ready:
                return None
            # Least in flight first; then the newest weights (the least stale tokens); then the one sent to longest
            # ago, so no server wins by its place.
            best = min(ready, key=lambda s: (s.in_flight, -s.holds.lineage, -s.holds.version, s.last_sent))
            if demand:
                share = -(-(sum(s.in_flight for s in healthy) + demand) // len(healthy))
                if best.in_flight >= share:
                    return None
            best.in_flight += 1
            best.last_sent = time.monotonic()
            return best.url

    def release(self, url: str) -> None:
        with self.lock:
            if (server := self._servers.get(url)) is not None:
                server.in_flight -= 1

    def view(self) -> list[ServerView]:
        with self.lock:
            return [ServerView(s.url, s.healthy, s.holds, s.in_flight) for s in self._servers.values()]


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
