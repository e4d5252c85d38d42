"""Request deadlines and stragglers, computed in one place from the request's `max_tokens` and the rollout server's
measured per-row decode rate (what each row of its current batch gets, tokens per second): the orchestrator, the
local runs and the benchmarks all use this, and a run is refused at load when its longest request cannot finish at
the declared floor rate within the deadline cap. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Deadline:
    timeout_s: float  # the attempt is given up after this (a deadline miss: not a fault of the server)
    straggler_after_s: float  # then it is also sent to another server (hedged)


def request_deadline(max_tokens: int, *, row_tokens_per_s: float | None, floor_tokens_per_s: float,
                     straggler_factor: float, allowance_s: float, cap_s: float) -> Deadline:
    """The timeout is what the slowest healthy server needs, decoding at the declared floor rate, plus a fixed
    allowance (queueing, prefill), within the cap. A straggler is a request slower than expected by
    `straggler_factor`, expected at the server's measured rate, and no earlier than the allowance (only the
    allowance where the server reports no rate)."""
    timeout = min(cap_s, allowance_s + max_tokens / floor_tokens_per_s)
    expected = max_tokens / row_tokens_per_s if row_tokens_per_s else 0.0
    return Deadline(timeout, min(timeout, max(allowance_s, straggler_factor * expected)))
