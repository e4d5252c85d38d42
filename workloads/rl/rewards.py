"""Tasks and rewards. The built-in task is verifiable arithmetic; rewards combine exact-answer checking, a format
reward, an optional custom function (by import path) and an optional remote reward service over HTTP.

A reward that raises, times out or returns a non-number is counted and scores `failure_reward`: one bad scorer
must not stop a run that costs GPUs by the hour."""
from __future__ import annotations

import importlib
import json
import logging
import math
import random
import re
import threading
import urllib.request
from dataclasses import dataclass
from typing import Callable

from moe_rl_eks.core.rl_config import RewardConfig, TaskConfig
from moe_rl_eks.core.schema import ConfigError

log = logging.getLogger(__name__)
RewardFn = Callable[[str, str, str], float]
INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    index: int
    prompt: str
    answer: str


class ArithmeticTask:
    """Problem i is a pure function of (seed, i), so a resumed run draws the same prompts from its cursor."""

    def __init__(self, cfg: TaskConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    def problem(self, index: int) -> Problem:
        rng = random.Random(self.seed * 1_000_003 + index)
        a, b = rng.randint(0, self.cfg.max_operand), rng.randint(0, self.cfg.max_operand)
        op = rng.choice(self.cfg.operators)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Problem(index, f"{a}{op}{b}=", str(answer))

    def well_formed_example(self, index: int) -> str:
        """A completion of the right shape but a random value: the supervised warm-up teaches the format only,
        so the reward that RL adds is measured separately from what warm-up taught."""
        rng = random.Random(self.seed * 7_919 + index)
        answers = sorted({int(self.problem(i).answer) for i in range(64)})
        return str(rng.randint(min(answers), max(answers)))


def exact_answer(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer else 0.0


def well_formed(completion: str, finished: bool) -> float:
    """1 for an integer followed by end-of-sequence (not cut off by max_tokens)."""
    return 1.0 if finished and INTEGER.fullmatch(completion) else 0.0


def import_reward(path: str) -> RewardFn:
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("rl.reward", "custom", path, f"cannot import it ({exc})") from None
    if not callable(fn):
        raise ConfigError("rl.reward", "custom", path, "is not callable")
    return fn


def remote_reward(url: str, timeout_s: float) -> RewardFn:
    def score(prompt: str, completion: str, answer: str) -> float:
        body = json.dumps({"prompt": prompt, "completion": completion, "answer": answer}).encode()
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.load(resp)["reward"]
    return score


class RewardScorer:
    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.extra: list[tuple[str, RewardFn]] = []
        if cfg.custom:
            self.extra.append(("custom", import_reward(cfg.custom)))
        if cfg.remote_url:
            self.extra.append(("remote", remote_reward(cfg.remote_url, cfg.remote_timeout_s)))
        self.failures = 0
        self._lock = threading.Lock()

    def score(self, prompt: str, completion: str, answer: str, finished: bool) -> float:
        total = (self.cfg.correct_weight * exact_answer(completion, answer)
                 + self.cfg.format_weight * well_formed(completion, finished))
        for name, fn in self.extra:
            try:
                value = fn(prompt, completion, answer)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise TypeError(f"returned {value!r}, expected a finite number")
                total += float(value)
            except Exception as exc:  # noqa: BLE001 -- any failure of user code is counted, never fatal
                with self._lock:
                    self.failures += 1
                log.warning("%s reward failed (%s); scoring %s", name, exc, self.cfg.failure_reward)
                total += self.cfg.failure_reward
        return total
