"""The rollout engine's histograms take a count per observation (a decode step's rows share one latency); their
exposition must be what prometheus_client's own Histogram shows for the same observations, so dashboards and
alerts written against vLLM's metrics keep working."""
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from moe_rl_eks.core import metrics as M
from moe_rl_eks.workloads.rl.runtime import Registry


def samples(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if line and "_created" not in line]


def test_an_observation_with_a_count_exposes_as_that_many_plain_observations():
    ours = Registry()
    theirs = CollectorRegistry()
    metric = M.ROLLOUT_INTER_TOKEN_LATENCY
    reference = Histogram(metric.name, metric.help, registry=theirs, buckets=metric.buckets)
    for value, count in [(0.0, 3), (0.001, 2), (0.0305, 5), (0.04, 1), (7.5, 4), (900.0, 2)]:  # on bounds, between, beyond
        ours[metric].observe(value, count)
        for _ in range(count):
            reference.observe(value)
    assert samples(ours.exposition()) == samples(generate_latest(theirs))
    assert f"{metric.name}_created" in ours.exposition().decode()
