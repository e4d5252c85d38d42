"""A rollout server's counters as its /metrics exports them (Prometheus text): what the benchmarks read around a
run, from a server in their own process or one at a URL alike."""
from __future__ import annotations

import urllib.request

from moe_rl_eks.core import metrics as M

COUNTERS = {M.ROLLOUT_BUSY_SECONDS.name: "busy_seconds", M.ROLLOUT_GENERATION_TOKENS.name: "generated_tokens",
            M.WEIGHT_LOAD_SECONDS.name: "load_seconds", M.ROLLOUT_DEVICE_SECONDS.name: "device_seconds",
            M.ROLLOUT_STEPS.name: "engine_steps", M.ROLLOUT_WEIGHT_VERSION.name: "weight_version"}


def rollout_counters(url: str) -> dict[str, float]:
    """The server's generating seconds (and the device's part of them), engine steps, generated tokens, last
    weight-load seconds and the weight version it serves; 0 for one it has not exported yet."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = {COUNTERS[s.name]: s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name in COUNTERS}
    return {name: found.get(name, 0.0) for name in COUNTERS.values()}
