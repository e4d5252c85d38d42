"""Prometheus metric names: emitted by workloads/, scraped and alerted on by infra/, plotted by the dashboard."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms: upper bounds in the metric's unit


# Latency buckets from 1 ms to 10 min: a decode step is milliseconds, a long rollout minutes.
_SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 320.0, 600.0)


ROLLOUT_TOKENS_PER_SECOND = Metric("moerl_rollout_tokens_per_second", "gauge", "Generated tokens per second on this rollout server")
ROLLOUT_QUEUE_DEPTH = Metric("moerl_rollout_queue_depth", "gauge", "Rollout requests the orchestrator has queued or in flight (autoscaling signal)")
ROLLOUT_REQUESTS = Metric("moerl_rollout_requests_total", "counter", "Completion requests served")
# The rollout server's request metrics carry vLLM's names with `vllm:` replaced by `moerl_rollout_` (same quantity,
# same unit, same kind), so a vLLM dashboard works after that one substitution. Rows are vLLM's requests: a
# request with n choices is n rows.
ROLLOUT_RUNNING = Metric("moerl_rollout_num_requests_running", "gauge", "Rows decoding on this rollout server")
ROLLOUT_WAITING = Metric("moerl_rollout_num_requests_waiting", "gauge", "Rows waiting for a batch slot on this rollout server")
ROLLOUT_KV_CACHE_USAGE = Metric("moerl_rollout_kv_cache_usage_perc", "gauge", "Fraction of the KV-cache blocks that rows hold on this rollout server (1 = full; vLLM's kv_cache_usage_perc)")
ROLLOUT_PREEMPTIONS = Metric("moerl_rollout_num_preemptions_total", "counter", "Decoding rows whose KV-cache blocks were taken back (KV cache full) to be recomputed later")
ROLLOUT_PROMPT_TOKENS = Metric("moerl_rollout_prompt_tokens_total", "counter", "Prompt tokens of the requests a rollout server accepted")
ROLLOUT_GENERATION_TOKENS = Metric("moerl_rollout_generation_tokens_total", "counter", "Tokens a rollout server generated")
ROLLOUT_REQUEST_SUCCESS = Metric("moerl_rollout_request_success_total", "counter", "Rows finished, by finish reason (stop, length, abort)", ("finished_reason",))
ROLLOUT_E2E_LATENCY = Metric("moerl_rollout_e2e_request_latency_seconds", "histogram", "Completion request latency, arrival to last token", buckets=_SECONDS)
ROLLOUT_TIME_TO_FIRST_TOKEN = Metric("moerl_rollout_time_to_first_token_seconds", "histogram", "Time from a request's submission to the engine (after HTTP parsing and validation) to each row's first token", buckets=_SECONDS)
ROLLOUT_INTER_TOKEN_LATENCY = Metric("moerl_rollout_inter_token_latency_seconds", "histogram", "Time between consecutive tokens of a row", buckets=_SECONDS)
ROLLOUT_REQUEST_ERRORS = Metric("moerl_rollout_request_errors_total", "counter", "Requests a rollout server answered with an error, by HTTP status", ("status",))
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
ROLLOUT_WEIGHT_LINEAGE = Metric("moerl_rollout_weight_lineage", "gauge", "Trainer lineage of the weight version this rollout server serves")
ROLLOUT_SWAPS_IN_FLIGHT = Metric("moerl_rollout_swaps_in_flight_total", "counter", "Weight versions this rollout server swapped in while rows were running (rollout.weight_swap: inflight)")
ROLLOUT_ROWS_AT_SWAP = Metric("moerl_rollout_rows_at_swap_total", "counter", "Rows running when a weight version was swapped in under them (their next tokens are the new version's)")
# Per token: a trained sample's token sampled with version v at step s counts s - v (0 = on-policy).
SAMPLE_TOKEN_STALENESS = Metric("moerl_sample_token_staleness", "histogram", "Weight-version lag of each trained token (trainer step minus the version that sampled it)", buckets=(0, 1, 2, 3, 4, 6, 8, 16))
ROLLOUT_BUSY_SECONDS = Metric("moerl_rollout_busy_seconds_total", "counter", "Seconds this rollout server spent generating")
# Of the busy seconds, the device's span of each step's forwards and sampling (CUDA events; on a CPU their wall
# time); busy minus device is the engine's host time between them (scheduling, bookkeeping), when the GPU waits.
ROLLOUT_DEVICE_SECONDS = Metric("moerl_rollout_device_seconds_total", "counter", "Seconds of the rollout engine's steps the device spent on their forwards and sampling (the rest of the busy seconds is host work the GPU waits for)")
ROLLOUT_STEPS = Metric("moerl_rollout_engine_steps_total", "counter", "Engine steps (a prefill chunk and/or one decode forward of every running row) this rollout server ran")
ROLLOUT_RETRIES = Metric("moerl_rollout_retries_total", "counter", "Completion requests re-sent to another server (failure, deadline or straggler)")
ROLLOUT_DEADLINE_MISSES = Metric("moerl_rollout_deadline_misses_total", "counter", "Completion attempts given up at their deadline (from max_tokens and the server's per-row rate), apart from server faults")
REWARD_FAILURES = Metric("moerl_reward_failures_total", "counter", "Reward computations that failed (timeout, error or non-finite score); their samples are masked, not scored")
SAMPLES_FILTERED = Metric("moerl_samples_filtered_total", "counter", "Samples dropped by dynamic sampling (groups whose rewards do not vary)")
ORCHESTRATOR_RESTARTS = Metric("moerl_orchestrator_restarts", "gauge", "Times this run's orchestrator has started again from a persisted state (its own per-step file or a trainer checkpoint's); kept in that state, so it survives the restarts it counts")
ORCHESTRATOR_CATCH_UPS = Metric("moerl_orchestrator_catch_ups_total", "counter", "Catch-ups of the orchestrator's state to a trainer past it (restored from an older state), by the state caught up: own (the one it holds) or newest_checkpoint (the run's newest checkpoint's, taken for a state older than the trainer's record)", ("state",))
ORCHESTRATOR_CAUGHT_UP_STEPS = Metric("moerl_orchestrator_caught_up_steps_total", "counter", "Steps a catch-up took as trained from the trainer's record of its batches (steps the orchestrator's state never recorded)")
# The rollout's logprobs against the trainer's at the weights a batch starts from, over its completion tokens (in
# the exact numerics mode 1, 0, 0 for tokens sampled by those weights; tokens of older versions add policy lag).
LOGPROB_BITWISE_EQUAL = Metric("moerl_logprob_bitwise_equal_fraction", "gauge", "Fraction of the last batch's completion tokens whose rollout logprob equals the trainer's bitwise")
LOGPROB_ABS_DIFF_MAX = Metric("moerl_logprob_abs_diff_max", "gauge", "Largest |rollout - trainer| logprob of a completion token in the last batch (nats)")
LOGPROB_ABS_DIFF_MEAN = Metric("moerl_logprob_abs_diff_mean", "gauge", "Mean |rollout - trainer| logprob of the last batch's completion tokens (nats)")
CRITIC_EXPLAINED_VARIANCE = Metric("moerl_critic_explained_variance", "gauge", "PPO: 1 - Var(returns - values) / Var(returns) of the last batch, with the critic's values from before it trained on that batch (held out)")
# Routing replay's arrays (workloads/rl/routing_store.py): bytes as stored (after rl.routing.compression).
ROUTING_BYTES_WRITTEN = Metric("moerl_routing_written_bytes_total", "counter", "Bytes of routed expert ids this rollout server wrote to the routing store (routing replay)")
ROUTING_BYTES_READ = Metric("moerl_routing_read_bytes_total", "counter", "Bytes of routed expert ids this trainer rank read from the routing store (its own samples only)")
ROUTING_BYTES_DELETED = Metric("moerl_routing_deleted_bytes_total", "counter", "Bytes of routed expert ids the orchestrator deleted from the routing store (trained and checkpointed, never to train, or orphaned)")
ROUTING_BYTES_STORED = Metric("moerl_routing_stored_bytes", "gauge", "Bytes of routed expert ids in the routing store that the orchestrator's state refers to (waiting groups and batches not yet checkpointed)")
TRAINER_IDLE_FRACTION = Metric("moerl_trainer_idle_fraction", "gauge", "Fraction of trainer wall time spent waiting for batches")

ALL = (ROLLOUT_TOKENS_PER_SECOND, ROLLOUT_QUEUE_DEPTH, ROLLOUT_REQUESTS, ROLLOUT_RUNNING, ROLLOUT_WAITING,
       ROLLOUT_KV_CACHE_USAGE, ROLLOUT_PREEMPTIONS,
       ROLLOUT_PROMPT_TOKENS, ROLLOUT_GENERATION_TOKENS, ROLLOUT_REQUEST_SUCCESS, ROLLOUT_E2E_LATENCY,
       ROLLOUT_TIME_TO_FIRST_TOKEN, ROLLOUT_INTER_TOKEN_LATENCY, ROLLOUT_REQUEST_ERRORS, ROLLOUT_WEIGHT_LINEAGE,
       TRAINER_STEP_SECONDS,
       TRAINER_TOKENS_PER_SECOND, TRAINER_LAST_STEP_TIMESTAMP, SAMPLE_STALENESS, SAMPLES_DROPPED_STALE,
       STRAGGLER_RATIO, EXPERT_LOAD_IMBALANCE, REWARD_MEAN, WEIGHT_PUBLISH_SECONDS, WEIGHT_LOAD_SECONDS, ROLLOUT_WEIGHT_VERSION,
       ROLLOUT_SWAPS_IN_FLIGHT, ROLLOUT_ROWS_AT_SWAP, SAMPLE_TOKEN_STALENESS,
       ROLLOUT_BUSY_SECONDS, ROLLOUT_DEVICE_SECONDS, ROLLOUT_STEPS, ROLLOUT_RETRIES, ROLLOUT_DEADLINE_MISSES, REWARD_FAILURES, SAMPLES_FILTERED, TRAINER_IDLE_FRACTION,
       ORCHESTRATOR_RESTARTS, ORCHESTRATOR_CATCH_UPS, ORCHESTRATOR_CAUGHT_UP_STEPS, LOGPROB_BITWISE_EQUAL, LOGPROB_ABS_DIFF_MAX, LOGPROB_ABS_DIFF_MEAN,
       CRITIC_EXPLAINED_VARIANCE, ROUTING_BYTES_WRITTEN, ROUTING_BYTES_READ, ROUTING_BYTES_DELETED, ROUTING_BYTES_STORED)
