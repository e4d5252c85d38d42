"""Rewards: one function per run (`rl.reward.function`), scored for many completions at once.

- `arithmetic`: the built-in task's exact integer answer plus a format reward; pure and bounded by the
  completion's length, so it runs inline.
- `countdown`: the built-in countdown task's correct leading steps (a share) plus a format reward; inline too.
- `math`: the completion's answer checked against the ground truth by math-verify (LaTeX, \\boxed{}, fractions,
  expressions), plus the format reward.
- a custom function with verl's signature, `compute_score(data_source, solution_str, ground_truth, extra_info)`,
  returning a number or a mapping with a "score" (verl's reward functions return either).
- `remote_url`: an HTTP scorer, called with batches of items, several batches at once.

`math` and custom functions run in worker processes (fresh interpreters): every call has `timeout_s`, and a call that runs past it
has its process killed and replaced (a thread could not be stopped, and a hung sympy call would hold a core for
the rest of the run). A call that raises, times out or returns something other than a finite number yields
RewardResult(score=None, error=...): the orchestrator masks that sample; no made-up score enters a group.

Torch-free: the orchestrator and the reward worker processes import it."""
from __future__ import annotations

import importlib
import json
import logging
import math
import os
import queue
import re
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from moe_rl_eks.core.rl_config import RewardConfig
from moe_rl_eks.core.schema import ConfigError

from .data import Prompt

log = logging.getLogger(__name__)
INTEGER = re.compile(r"-?\d+")
Item = tuple[Prompt, str, bool]  # (prompt, completion text, finished: ended with a stop token, not max_tokens)
WORKER_START_TIMEOUT_S = 120  # importing a reward module (sympy for math) is not part of any call's timeout


@dataclass(frozen=True)
class RewardResult:
    score: float | None  # None = the reward failed (timeout, exception, not a number): mask the sample
    error: str | None = None


def exact_answer(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == str(answer) else 0.0


def well_formed(completion: str, finished: bool) -> float:
    """1 for an integer followed by end-of-sequence (not cut off by max_tokens)."""
    return 1.0 if finished and INTEGER.fullmatch(completion) else 0.0


def arithmetic_score(cfg: RewardConfig, prompt: Prompt, completion: str, finished: bool) -> float:
    return (cfg.correct_weight * exact_answer(completion, prompt.ground_truth)
            + cfg.format_weight * well_formed(completion, finished))


COUNTDOWN = re.compile(r"\d+( \d+)*")


def countdown_score(cfg: RewardConfig, prompt: Prompt, completion: str, finished: bool) -> float:
    """The countdown task (TaskConfig.countdown): the share of its numbers written correctly before the first wrong
    one (of the longer of the written and the correct sequence, so running on past the end costs too), plus the
    format reward for numbers separated by spaces and ended by end-of-sequence."""
    want, got = str(prompt.ground_truth).split(" "), completion.split(" ")
    right = next((i for i, (w, g) in enumerate(zip(want, got)) if w != g), min(len(want), len(got)))
    return (cfg.correct_weight * right / max(len(want), len(got))
            + cfg.format_weight * (1.0 if finished and COUNTDOWN.fullmatch(completion) else 0.0))


# Pure and bounded by the completion's length: scored inline, not in worker processes.
INLINE = {"arithmetic": arithmetic_score, "countdown": countdown_score}


def math_answer_score(completion: str, ground_truth: Any) -> tuple[bool, bool]:
    """(correct, answered): whether math-verify finds an answer in the completion, and whether it equals the
    ground truth. A bare ground truth is read as the content of \\boxed{} (datasets store "1/2", "\\frac{1}{2}")."""
    from math_verify import parse, verify

    # Its own signal-based timeouts are off: the worker's timeout is the one limit, and it reports failure.
    gold = parse(str(ground_truth) if "\\boxed" in str(ground_truth) or "$" in str(ground_truth)
                 else f"\\boxed{{{ground_truth}}}", parsing_timeout=None)
    answer = parse(completion, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot read the ground truth {ground_truth!r}")
    return bool(answer) and verify(gold, answer, timeout_seconds=None), bool(answer)


def _finite(value: Any) -> float:
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"returned {value!r}; expected a finite number or a mapping with a finite 'score'")
    return float(value)


def import_function(path: str) -> Callable:
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("rl.reward", "function", path, f"cannot import it ({exc})") from None
    if not callable(fn):
        raise ConfigError("rl.reward", "function", path, "is not callable")
    return fn


# --- worker processes --------------------------------------------------------------------------------------------

def _scorer_in_worker(function: str, correct_weight: float, format_weight: float) -> Callable[..., float]:
    if function == "math":
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call with timeouts off

        def score(data_source, solution_str, ground_truth, extra_info, finished):
            correct, answered = math_answer_score(solution_str, ground_truth)
            return correct_weight * correct + format_weight * (answered and finished)
        return score
    fn = import_function(function)
    return lambda data_source, solution_str, ground_truth, extra_info, finished: \
        _finite(fn(data_source, solution_str, ground_truth, extra_info))


def _worker_main(conn, function: str, correct_weight: float, format_weight: float) -> None:
    """Say "ready", then score one item per message, forever: (data_source, solution_str, ground_truth,
    extra_info, finished) -> ("ok", score) or ("error", message)."""
    score = _scorer_in_worker(function, correct_weight, format_weight)
    conn.send(("ready", None))
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", _finite(score(*item))))
        except Exception as exc:  # noqa: BLE001 -- user code: any failure is reported, the worker lives on
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class RewardWorkerError(RuntimeError):
    """A reward worker process could not start: the setup is broken, so this is raised, not masked per sample."""


def worker_entry(argv: list[str]) -> None:
    """The worker process's main: argv = [socket fd, function, correct_weight, format_weight]."""
    from multiprocessing.connection import Connection

    _worker_main(Connection(int(argv[0])), argv[1], float(argv[2]), float(argv[3]))


class _Worker:
    """One scoring process, started as a fresh interpreter (not multiprocessing's spawn, which re-runs the
    parent's __main__ and fails when that is not a file) and talked to over a socket pair."""

    def __init__(self, cfg: RewardConfig) -> None:
        import socket
        import subprocess
        import sys
        from multiprocessing.connection import Connection

        mine, theirs = socket.socketpair()
        code = "import sys; from moe_rl_eks.workloads.rl.rewards import worker_entry; worker_entry(sys.argv[1:])"
        # The parent's import path, so the worker imports what the parent imported (a custom reward module).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno()), cfg.function,
                                      str(cfg.correct_weight), str(cfg.format_weight)],
                                     pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(mine.detach())
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        try:
            if not self.conn.poll(WORKER_START_TIMEOUT_S):
                raise RewardWorkerError(f"a reward worker did not start within {WORKER_START_TIMEOUT_S} s")
            self.conn.recv()
        except (EOFError, OSError):
            raise RewardWorkerError(f"a reward worker exited with code {self.proc.wait()} before it started; its "
                                    "error is in this process's log (stderr)") from None
        self.ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=5)
        self.conn.close()


class WorkerPool:
    """`size` scoring processes. A call checks a worker out of the idle queue, so each worker serves one call at
    a time; a worker whose call times out (or dies) is killed and replaced by a fresh one."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.idle: queue.Queue[_Worker] = queue.Queue()
        for _ in range(cfg.workers):
            self.idle.put(_Worker(cfg))
        self.threads = ThreadPoolExecutor(cfg.workers, thread_name_prefix="reward")

    def call(self, item: tuple) -> RewardResult:
        worker = self.idle.get()
        try:
            worker.wait_ready()
            worker.conn.send(item)
            if not worker.conn.poll(self.cfg.timeout_s):
                raise TimeoutError(f"no score within rl.reward.timeout_s ({self.cfg.timeout_s:g} s)")
            status, value = worker.conn.recv()
        except (TimeoutError, EOFError, OSError) as exc:
            worker.kill()
            worker = _Worker(self.cfg)
            why = str(exc) if isinstance(exc, TimeoutError) else f"the reward worker died ({type(exc).__name__})"
            return RewardResult(None, why)
        finally:
            self.idle.put(worker)
        return RewardResult(value, None) if status == "ok" else RewardResult(None, value)

    def map(self, items: list[tuple]) -> list[RewardResult]:
        return list(self.threads.map(self.call, items))

    def close(self) -> None:
        self.threads.shutdown(wait=True)
        while not self.idle.empty():
            self.idle.get().kill()


# --- remote ------------------------------------------------------------------------------------------------------

def _remote_batch(url: str, timeout_s: float, batch: list[dict]) -> list[RewardResult]:
    """POST {"items": [...]} -> {"scores": [number | null, ...]} in the same order; a failed request fails every
    item of its batch, a null fails its item."""
    req = urllib.request.Request(url, data=json.dumps({"items": batch}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            scores = json.load(resp)["scores"]
        if not isinstance(scores, list) or len(scores) != len(batch):
            raise ValueError(f"expected {len(batch)} scores, got {scores!r:.200}")
    except Exception as exc:  # noqa: BLE001 -- network, HTTP status, malformed answers: all fail the batch
        return [RewardResult(None, f"remote reward {url}: {type(exc).__name__}: {exc}")] * len(batch)
    out = []
    for s in scores:
        try:
            out.append(RewardResult(_finite(s), None))
        except TypeError as exc:
            out.append(RewardResult(None, f"remote reward {url}: {exc}"))
    return out


# --- the scorer --------------------------------------------------------------------------------------------------

class RewardScorer:
    """Scores (prompt, completion, finished) items with the run's reward function. `score_many` is thread-safe;
    `failures` and `calls` are counted under one lock."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.failures = self.calls = 0
        self._lock = threading.Lock()
        self._pool: WorkerPool | None = None
        self._remote: ThreadPoolExecutor | None = None
        if cfg.remote_url:
            self._remote = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="remote-reward")
        elif cfg.custom:
            import_function(cfg.custom)  # a wrong path is a config error now, not a failure per sample later

    def score_many(self, items: list[Item]) -> list[RewardResult]:
        if self.cfg.remote_url:
            results = self._score_remote(items)
        elif self.cfg.function in INLINE:
            score = INLINE[self.cfg.function]
            results = [RewardResult(score(self.cfg, p, text, finished), None) for p, text, finished in items]
        else:
            if self._pool is None:
                with self._lock:
                    self._pool = self._pool or WorkerPool(self.cfg)
            results = self._pool.map([(p.data_source, text, p.ground_truth, p.extra_info, finished)
                                      for p, text, finished in items])
        failed = [r for r in results if r.score is None]
        with self._lock:
            self.calls += len(results)
            self.failures += len(failed)
        for r in failed[:1]:
            log.warning("%d of %d rewards failed, e.g. %s", len(failed), len(results), r.error)
        return results

    def _score_remote(self, items: list[Item]) -> list[RewardResult]:
        payload = [{"data_source": p.data_source, "solution_str": text, "ground_truth": p.ground_truth,
                    "extra_info": p.extra_info, "prompt": p.text, "finished": finished} for p, text, finished in items]
        size = self.cfg.remote_batch_size
        batches = [payload[i:i + size] for i in range(0, len(payload), size)]
        done = self._remote.map(lambda b: _remote_batch(self.cfg.remote_url, self.cfg.timeout_s, b), batches)
        return [r for batch in done for r in batch]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._remote is not None:
            self._remote.shutdown(wait=False)
