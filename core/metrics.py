"""Prometheus metric names: emitted by workloads/, scraped and alerted on by infra/, plotted by the dashboard."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str


ROLLOUT_TOKENS_PER_SECOND = Metric("moerl_rollout_tokens_per_second", "gauge", "Generated tokens per second on this rollout server")
ROLLOUT_QUEUE_DEPTH = Metric("moerl_rollout_queue_depth", "gauge", "Rollout requests the orchestrator has queued or in flight (autoscaling signal)")
ROLLOUT_REQUESTS = Metric("moerl_rollout_requests_total", "counter", "Completion requests served")
TRAINER_STEP_SECONDS = Metric("moerl_trainer_step_seconds", "gauge", "Wall time of the last optimizer step")
TRAINER_TOKENS_PER_SECOND = Metric("moerl_trainer_tokens_per_second", "gauge", "Trained tokens per second")
TRAINER_LAST_STEP_TIMESTAMP = Metric("moerl_trainer_last_step_timestamp_seconds", "gauge", "Unix time of the last finished optimizer step")
SAMPLE_STALENESS = Metric("moerl_sample_staleness", "gauge", "Mean weight-version lag of the samples in the last batch")
SAMPLES_DROPPED_STALE = Metric("moerl_samples_dropped_stale_total", "counter", "Samples dropped for exceeding max_staleness")
STRAGGLER_RATIO = Metric("moerl_straggler_ratio", "gauge", "Slowest rank's arrival at the gradient all-reduce over the median rank's")
EXPERT_LOAD_IMBALANCE = Metric("moerl_expert_load_imbalance", "gauge", "Worst MoE layer's busiest expert over its mean load in the last batch")
REWARD_MEAN = Metric("moerl_reward_mean", "gauge", "Mean reward of the last batch")
WEIGHT_PUBLISH_SECONDS = Metric("moerl_weight_publish_seconds", "gauge", "Time to publish the last weight version")
WEIGHT_LOAD_SECONDS = Metric("moerl_weight_load_seconds", "gauge", "Time for a rollout server to load the last weight version")
ROLLOUT_WEIGHT_VERSION = Metric("moerl_rollout_weight_version", "gauge", "Weight version this rollout server serves")
ROLLOUT_BUSY_SECONDS = Metric("moerl_rollout_busy_seconds_total", "counter", "Seconds this rollout server spent generating")
ROLLOUT_RETRIES = Metric("moerl_rollout_retries_total", "counter", "Completion requests re-sent to another server (failure, deadline or straggler)")
REWARD_FAILURES = Metric("moerl_reward_failures_total", "counter", "Reward computations that failed and scored failure_reward")
SAMPLES_FILTERED = Metric("moerl_samples_filtered_total", "counter", "Samples dropped by dynamic sampling (groups whose rewards do not vary)")
TRAINER_IDLE_FRACTION = Metric("moerl_trainer_idle_fraction", "gauge", "Fraction of trainer wall time spent waiting for batches")

ALL = (ROLLOUT_TOKENS_PER_SECOND, ROLLOUT_QUEUE_DEPTH, ROLLOUT_REQUESTS, TRAINER_STEP_SECONDS,
       TRAINER_TOKENS_PER_SECOND, TRAINER_LAST_STEP_TIMESTAMP, SAMPLE_STALENESS, SAMPLES_DROPPED_STALE,
       STRAGGLER_RATIO, EXPERT_LOAD_IMBALANCE, REWARD_MEAN, WEIGHT_PUBLISH_SECONDS, WEIGHT_LOAD_SECONDS, ROLLOUT_WEIGHT_VERSION,
       ROLLOUT_BUSY_SECONDS, ROLLOUT_RETRIES, REWARD_FAILURES, SAMPLES_FILTERED, TRAINER_IDLE_FRACTION)
