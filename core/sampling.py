"""Sampling limits: the one definition of the values a row's sampling may take. The run configuration
(`rl.sampling`, `rl.evaluation`), the rollout server's HTTP schema and the engine's `SamplingParams` all check
against these, so a run the servers would refuse is refused when it is loaded, and no layer is stricter than
another. Torch-free and dependency-free."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Limit:
    """The closed or open range of one numeric sampling field, and what it means at its ends."""

    name: str
    low: float
    high: float | None = None  # None: unbounded above
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    note: str = ""  # what a special value means, e.g. "0 = greedy"

    def allows(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not self.integer and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def allowed(self) -> str:
        """What is allowed, in the words error messages use: 'a number in [0, 10] (0 = greedy)'."""
        kind = "an integer" if self.integer else "a number"
        low = _show(self.low)
        if self.high is None:
            text = f"{kind} {'>' if self.low_open else '>='} {low}"
        else:
            text = (f"{kind} in {'(' if self.low_open else '['}{low}, {_show(self.high)}"
                    f"{')' if self.high_open else ']'}")
        return f"{text} ({self.note})" if self.note else text

    def bounds(self) -> dict[str, float]:
        """The range as pydantic / JSON Schema bounds (ge, gt, le, lt)."""
        out = {"gt" if self.low_open else "ge": self.low}
        if self.high is not None:
            out["lt" if self.high_open else "le"] = self.high
        return out


def _show(value: float) -> str:
    if value == 2**64:
        return "2**64"
    return str(int(value)) if float(value).is_integer() else str(value)


# Seeds are the two 32-bit words of the engine's counter-based generator; OpenAI clients send any uint64.
SEED_LIMIT = 2**64
MAX_TOP_LOGPROBS = 20  # alternatives per token: OpenAI's chat limit and vLLM's default cap
MAX_STOP_STRINGS = 16
LOGPROB_MODES = ("processed", "raw")  # processed = of the distribution sampled from (what an RL trainer scores)

MAX_TOKENS = Limit("max_tokens", 1, integer=True)
# Above 10 a softmax over a real vocabulary is close to uniform: such a request is a mistake, not a setting.
TEMPERATURE = Limit("temperature", 0, 10, note="0 = greedy")
TOP_P = Limit("top_p", 0, 1, low_open=True)
TOP_K = Limit("top_k", 0, integer=True, note="0 = off")
MIN_P = Limit("min_p", 0, 1)
SEED = Limit("seed", 0, SEED_LIMIT, high_open=True, integer=True)
TOP_LOGPROBS = Limit("top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
