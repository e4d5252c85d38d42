"""RL section of a run configuration (`rl:` in `configs/runs/<name>.yaml`): algorithm, loss, task, rewards,
orchestration, weight store and checkpoints. Read by the orchestrator, the trainers, the rollout servers and the
manifests alike, so it imports nothing heavy.

Invariants that span processes are checked here once (e.g. routing replay needs the rollout servers to return
routed experts, which they do on request, so the orchestrator asks for them when `routing_replay` is on).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .sampling import MAX_TOKENS, TEMPERATURE, TOP_P, Limit
from .schema import fail


TOKEN_RATIO_CLIP = (0.2, 0.28)
SEQUENCE_RATIO_CLIP = (3e-4, 4e-4)  # GSPO (Zheng et al. 2025)


def check_limit(limit: Limit, value, alternative: str = "") -> None:
    """Refuse a sampling value the rollout servers would refuse, naming it and what they allow."""
    if not limit.allows(value):
        fail(limit.name, value, f"must be {limit.allowed()}{alternative}: the rollout servers refuse anything else")


@dataclass(frozen=True)
class AlgorithmConfig:
    """How scored groups become per-token advantages, and the policy loss."""

    # grpo: group-normalised advantages, token-mean loss; dr_grpo: Dr. GRPO (centred advantages, loss divided
    # by the constant sequences x rl.sampling.max_tokens); gspo: sequence-level ratio and clip, sequence-mean
    # loss; ppo: a critic, whitened GAE advantages (workloads/rl/algorithms.py).
    name: Literal["grpo", "dr_grpo", "gspo", "ppo"] = "grpo"
    group_size: int = 8  # completions per prompt (GRPO's group; PPO samples them too)
    # grpo and gspo: divide the centred rewards by the group's std. false centres only, keeping the token-mean
    # loss (DAPO's aggregation); that is not Dr. GRPO, whose constant normaliser is `name: dr_grpo`.
    scale_by_std: bool = True
    dynamic_sampling: bool = False  # drop groups whose rewards do not vary (they carry no GRPO signal)
    # The ratio is clipped to [1 - clip_low, 1 + clip_high]; clip_high > clip_low = clip-higher. Default: 0.2 / 0.28
    # for the token-level ratio, 3e-4 / 4e-4 for GSPO's sequence-level one (its paper's ranges: a sequence ratio
    # is a geometric mean over tokens and moves far less than one token's).
    clip_low: float | None = None
    clip_high: float | None = None
    # The off-policy correction of the decoupled objective (workloads/rl/losses.py): each token (GSPO: each
    # sequence) weighed by w = pi_proximal / pi_behaviour, the rollout's logprob against the trainer's, which differ
    # by policy lag (max_staleness) and by numerics. `truncated`: w = min(w, importance_cap) (TIS); a cap of 1 still
    # weighs tokens the rollout found likelier than the trainer does below 1. `none`: w = 1 exactly and the rollout's
    # logprobs are not read by the loss (only by the importance_weight_mean metric): the on-policy objective, right
    # where nothing is off-policy (numerics: exact with max_staleness 0), and the uncorrected baseline of a numerics
    # A/B elsewhere (docs/benchmarks.md).
    importance_correction: Literal["truncated", "none"] = "truncated"
    importance_cap: float = 2.0  # with importance_correction: truncated, the largest weight
    kl_coef: float = 0.0  # KL to the frozen initial policy; 0 = no reference model is kept
    # k1; k3 (log-ratio clamped to +-20, estimate to <= 10, as verl); k3+ (k3's value, k2's unbiased gradient)
    kl_estimator: Literal["k1", "k3", "k3+"] = "k3"
    entropy_coef: float = 0.0
    epochs_per_batch: int = 1  # passes over each batch; > 1 makes the clipped ratio bite
    mini_batches: int = 1  # optimizer steps per pass: the batch is split into this many parts
    gamma: float = 1.0  # PPO: discount
    gae_lambda: float = 1.0  # PPO: GAE lambda (1.0 as verl's LLM default: a reward at the end reaches every token)
    value_coef: float = 0.5  # PPO: weight of the value loss
    value_clip: float = 0.2  # PPO: clip of the value update around the rollout-time values
    # PPO's critic (workloads/trainer/critic.py: a two-layer MLP on the policy's detached final hidden states and
    # the answer's progress through max_tokens) is trained by its own AdamW parameter group at this constant rate:
    # it starts from nothing while the policy is pretrained, so the policy's rate (1e-6 on a 30B model) would leave
    # it at V ~ 0 for the whole run. Its gradient is clipped apart from the policy's, at rl.training.grad_clip.
    critic_lr: float = 1e-3
    # PPO: the run's first RL steps train the critic alone, the policy frozen (its weights, moments and schedule
    # untouched), so the first policy update reads advantages from a critic that has seen the task's returns.
    critic_warmup_steps: int = 0
    # PPO: after a batch's optimizer steps, this many more passes over its mini-batches fit the critic alone
    # (workloads/trainer/critic.py fit_on_stored), on the critic's inputs kept from the batch's last pass (the
    # policy's detached hidden states and prefix features: no forward of the trunk). A critic that fits each
    # batch's returns more closely gives the next batch less noisy advantages; 0 = none.
    critic_epochs: int = 0
    routing_replay: bool = False  # train on the experts the rollout chose (R3)

    def validate(self) -> None:
        if self.group_size < 2 and self.name != "ppo":
            fail("group_size", self.group_size, f"{self.name} needs >= 2 completions per prompt (its group)")
        if self.group_size < 1:
            fail("group_size", self.group_size, "must be >= 1")
        for name in ("clip_low", "clip_high"):
            if getattr(self, name) is not None and not 0 < getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be between 0 and 1 (exclusive), or omitted for the default")
        if self.importance_cap < 1:
            fail("importance_cap", self.importance_cap, "must be >= 1: an on-policy token's weight is 1, and a cap "
                 "below would lower it (importance_correction: none turns the correction off)")
        for name in ("kl_coef", "entropy_coef", "value_coef", "value_clip"):
            if getattr(self, name) < 0:
                fail(name, getattr(self, name), "must be >= 0")
        for name in ("epochs_per_batch", "mini_batches"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        for name in ("gamma", "gae_lambda"):
            if not 0 <= getattr(self, name) <= 1:
                fail(name, getattr(self, name), "must be between 0 and 1")
        if not 0 < self.critic_lr <= 1:
            fail("critic_lr", self.critic_lr, "must be > 0 and <= 1")
        if self.critic_warmup_steps < 0:
            fail("critic_warmup_steps", self.critic_warmup_steps, "must be >= 0 (RL steps)")
        if self.critic_warmup_steps and self.name != "ppo":
            fail("critic_warmup_steps", self.critic_warmup_steps, f"must be 0 for {self.name}: only ppo has a critic")
        if self.critic_epochs < 0:
            fail("critic_epochs", self.critic_epochs, "must be >= 0 (passes over each batch)")
        if self.critic_epochs and self.name != "ppo":
            fail("critic_epochs", self.critic_epochs, f"must be 0 for {self.name}: only ppo has a critic")

    def ratio_clip(self) -> tuple[float, float]:
        """(clip_low, clip_high): as set, else the algorithm's default (see the fields)."""
        low, high = SEQUENCE_RATIO_CLIP if self.name == "gspo" else TOKEN_RATIO_CLIP
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)


@dataclass(frozen=True)
class TaskConfig:
    """The built-in verifiable tasks, each with its reward function of the same name (rl.reward.function):
    - `arithmetic`: `a <op> b =` with operands in [0, max_operand], the exact integer answer (a few tokens);
    - `countdown`: `a-b=` answered by writing out a-b, a-2b, ... down to the remainder a mod b, one number at a
      time (each written least significant digit first): a long, verifiable completion (4-5 tokens a step). The number of steps is drawn log-uniformly from
      [min_steps, max_steps], so lengths have a long tail; b is in [2, 9]. The reward counts the steps written
      correctly before the first wrong one. The supervised warm-up shows traces in which each step is wrong with
      probability `trace_error_rate` (the rest of that trace counts on from the wrong number), so the warmed-up
      policy knows the procedure but slips, and RL is what removes the slips.
    - `random_tokens`: for system benchmarks on random weights (`moerl bench-rl --gpu`), nothing to learn:
      `prompt_tokens` uniformly random token ids per prompt, each request's max_tokens drawn log-uniformly from
      [lo, rl.sampling.max_tokens] with lo set so the mean is `mean_completion_tokens` (a long tail); scored by the
      arithmetic reward (0 for all: GRPO's advantages are zero, the trainer's work is the same)."""

    name: Literal["arithmetic", "countdown", "random_tokens"] = "arithmetic"
    max_operand: int = 4
    operators: tuple[Literal["+", "-", "*"], ...] = ("+",)
    min_steps: int = 8
    max_steps: int = 128
    trace_error_rate: float = 0.05
    prompt_tokens: int = 256  # random_tokens
    mean_completion_tokens: int = 2000  # random_tokens

    def validate(self) -> None:
        for name in ("prompt_tokens", "mean_completion_tokens"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        if not 1 <= self.max_operand <= 999:
            fail("max_operand", self.max_operand, "must be between 1 and 999")
        if not self.operators:
            fail("operators", self.operators, "list at least one of '+', '-', '*'")
        if not 1 <= self.min_steps <= self.max_steps:
            fail("min_steps", self.min_steps, f"must be between 1 and max_steps ({self.max_steps})")
        if self.max_steps > 10_000:
            fail("max_steps", self.max_steps, "must be <= 10000")
        if not 0 <= self.trace_error_rate < 1:
            fail("trace_error_rate", self.trace_error_rate, "must be in [0, 1)")

    @staticmethod
    def countdown_text(values) -> str:
        """How a countdown is written: each number with its least significant digit first, so that a digit depends
        on the digits before it (the borrow), not after. At 48 steps a model warmed up on such traces got 89 % of
        its greedy steps right after 400 steps, against 46 % in the usual order (CPU experiment, 2026-12-01,
        docs/benchmarks.md)."""
        return " ".join(str(v)[::-1] for v in values)

    @classmethod
    def countdown(cls, a: int, b: int) -> str:
        """The countdown task's correct completion of `a-b=` (before its end-of-sequence token)."""
        return cls.countdown_text(range(a - b, -1, -b) if a >= b else [a])

    def longest_countdown_tokens(self) -> int:
        """Tokens of the longest correct countdown completion (max_steps steps of b = 9 from 9 x max_steps + 8),
        its end-of-sequence token included: the built-in vocabulary has one token per character."""
        return len(self.countdown(9 * self.max_steps + 8, 9)) + 1


BUILTIN_REWARDS = ("arithmetic", "countdown", "math")
DATA_SUFFIXES = (".parquet", ".jsonl")
GLOB_CHARS = "*?["
DATA_LOCATIONS = ("expected a .parquet or .jsonl file, a directory or S3 prefix holding them (end a name that has a "
                  "dot with /), or a glob such as data/train-*.parquet")


def data_location_problem(entry: str) -> str | None:
    """Why `entry` cannot name dataset files (None when it can): a file, a directory or S3 prefix, or a glob."""
    if not entry:
        return DATA_LOCATIONS
    if entry.startswith("s3://"):
        bucket, slash, _ = entry[len("s3://"):].partition("/")
        if not bucket or not slash or any(c in bucket for c in GLOB_CHARS):
            return "expected s3://bucket/key, s3://bucket/prefix/ or s3://bucket/dir/*.parquet"
    name = entry.rstrip("/").rsplit("/", 1)[-1]
    if (not entry.endswith("/") and "." in name and not name.endswith(DATA_SUFFIXES)
            and not any(c in name for c in GLOB_CHARS)):
        return DATA_LOCATIONS
    return None


@dataclass(frozen=True)
class DataColumns:
    """Where a dataset row keeps each part; dotted names reach into nested columns. Defaults are verl's layout."""

    prompt: str = "prompt"  # chat messages ([{role, content}], rendered with the tokenizer's template) or text
    ground_truth: str = "reward_model.ground_truth"
    data_source: str = "data_source"  # optional column: missing = the file's name
    extra_info: str = "extra_info"  # optional column: missing = {}

    def validate(self) -> None:
        for name in ("prompt", "ground_truth", "data_source", "extra_info"):
            value = getattr(self, name)
            if not value or not all(value.split(".")):
                fail(name, value, "expected a column name, dotted for a field of a nested column (a.b)")


@dataclass(frozen=True)
class DataConfig:
    """The prompts: the built-in arithmetic task (`rl.task`) unless `train` names a dataset: Parquet or JSONL (one
    JSON object per line) on a local path, the FSx mount or S3. A split is one location or a list of them; a
    location is a file, a directory or S3 prefix (its .parquet/.jsonl files, not its subdirectories), or a glob
    (`**` for any depth). The files of a split are read back to back: each location's in name order, the
    locations in the order listed."""

    train: str | tuple[str, ...] | None = None
    eval: str | tuple[str, ...] | None = None  # evaluation split; default: none for a dataset, fresh built-in problems
    columns: DataColumns = field(default_factory=DataColumns)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false} (Qwen3)
    shuffle: bool = True  # a seeded permutation per epoch (seed: rl.training.seed); false = file order
    s3_endpoint_url: str | None = None  # a non-AWS endpoint (tests use moto's server on 127.0.0.1)

    def validate(self) -> None:
        for name in ("train", "eval"):
            value = getattr(self, name)
            if value is None:
                continue
            if not value:
                fail(name, value, "list at least one file, directory, S3 prefix or glob")
            for i, entry in enumerate(self.locations(name)):
                problem = data_location_problem(entry)
                if problem:
                    fail(name if isinstance(value, str) else f"{name}[{i}]", entry, problem)
        if self.eval is not None and self.train is None:
            fail("eval", self.eval, "an evaluation split needs a training dataset (rl.data.train)")

    def locations(self, split: str) -> tuple[str, ...]:
        """The split's locations as a tuple (empty when the split is unset)."""
        value = getattr(self, split)
        return () if value is None else (value,) if isinstance(value, str) else tuple(value)

    @property
    def builtin(self) -> bool:
        return self.train is None


@dataclass(frozen=True)
class RewardConfig:
    """One reward function, chosen once: `arithmetic` (exact integer answer; the built-in task), `math` (the answer
    checked by math-verify against the ground truth, LaTeX and \\boxed{} included), or a custom function with verl's
    signature `compute_score(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float}` by
    import path. Built-ins score `correct_weight * correct + format_weight * finished-and-answered`.
    `remote_url`, when set, scores instead over HTTP (batches of `remote_batch_size`, `max_concurrency` at once).

    Every call runs under `timeout_s`; a call that raises, times out or returns a non-number fails: its sample is
    masked (dropped from its group) and counted, never given a made-up score. `math` and custom functions run in
    `workers` separate processes, so a call that hangs is killed rather than left running."""

    function: str = "arithmetic"  # "arithmetic", "countdown", "math" or "package.module:function"
    correct_weight: float = 1.0
    format_weight: float = 0.1
    remote_url: str | None = None  # POST {"items": [{data_source, solution_str, ground_truth, extra_info}]}
    timeout_s: float = 10.0  # per call (per batch for remote)
    workers: int = 2  # processes for math and custom functions
    remote_batch_size: int = 32
    max_concurrency: int = 8  # remote batches in flight
    pass_threshold: float = 1.0  # a sample is correct (accuracy, pass@k) when its reward is >= this

    def validate(self) -> None:
        if self.function not in BUILTIN_REWARDS and (
                self.function.count(":") != 1 or not all(self.function.split(":"))):
            fail("function", self.function, "expected 'arithmetic', 'countdown', 'math' or 'package.module:function'")
        if self.remote_url is not None and not self.remote_url.startswith(("http://", "https://")):
            fail("remote_url", self.remote_url, "expected an http:// or https:// URL")
        if self.timeout_s <= 0:
            fail("timeout_s", self.timeout_s, "must be > 0 seconds")
        for name in ("workers", "remote_batch_size", "max_concurrency"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")

    @property
    def custom(self) -> str | None:
        return None if self.function in BUILTIN_REWARDS else self.function


@dataclass(frozen=True)
class EvaluationConfig:
    """Evaluation on the evaluation split (or fresh built-in problems) every `every_steps` and at the end:
    mean reward, pass@1 and pass@k (k = samples_per_prompt), response length and truncation rate."""

    every_steps: int = 0  # 0 = only at the end
    prompts: int = 128  # at most this many evaluation prompts (the first ones of the split)
    samples_per_prompt: int = 4  # n of the unbiased pass@k estimator; pass@k is reported for k = this
    temperature: float = 1.0
    max_tokens: int | None = None  # default: rl.sampling.max_tokens
    # A local run keeps its initial and post-warm-up weights (float32, the whole model) to evaluate after it; false:
    # it keeps none (a benchmark: 22 GB each at 8 layers of the 30B shape, written before the first step)
    snapshots: bool = True

    def validate(self) -> None:
        if self.every_steps < 0:
            fail("every_steps", self.every_steps, "must be >= 0 (0 = only at the end)")
        for name in ("prompts", "samples_per_prompt"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        check_limit(TEMPERATURE, self.temperature)
        if self.max_tokens is not None:
            check_limit(MAX_TOKENS, self.max_tokens, " or omitted")


@dataclass(frozen=True)
class SamplingConfig:
    """What the orchestrator asks the rollout servers for, and what the servers accept. Each value is checked
    against the limits every server applies (core/sampling.py), so a run they would refuse does not load."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 4  # completion length cap per request (<= rollout.max_new_tokens)
    max_prompt_tokens: int = 512  # servers reject longer prompts with 400
    max_n: int = 64  # servers reject larger `n` with 400
    # "builtin" (the built-in task's character vocabulary), a Hugging Face model directory (tokenizer.json,
    # tokenizer_config.json with the chat template, generation_config.json with the stop ids), or a tokenizer.json
    tokenizer: str = "builtin"
    # Rows run to their max_tokens through the model's EOS ids (vLLM's ignore_eos): a benchmark's lengths are drawn
    # (rl.task random_tokens), not left to a random model's samples.
    ignore_eos: bool = False

    def validate(self) -> None:
        for limit in (TEMPERATURE, TOP_P, MAX_TOKENS):
            check_limit(limit, getattr(self, limit.name))
        if self.temperature == 0:
            fail("temperature", self.temperature, "must be > 0 (greedy decoding is not used for RL)")
        if self.top_p != 1:
            fail("top_p", self.top_p, "must be 1 for RL: below 1 the rollout's logprobs are renormalised over the "
                 "nucleus while the trainer scores the whole distribution at the temperature, so every importance "
                 "weight would be biased low without a word")
        for name in ("max_prompt_tokens", "max_n"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")


@dataclass(frozen=True)
class OrchestratorConfig:
    max_staleness: int = 1  # newest trainer version minus oldest in-flight version; 0 = synchronous on-policy
    # Deadlines follow each request's max_tokens (core/deadlines.py): an attempt is given up after the time the
    # slowest healthy server needs (rollout.min_row_tokens_per_s) plus straggler_after_s, never after
    # request_timeout_s, and retried elsewhere with a new seed; it is hedged once it runs straggler_factor x longer
    # than the server's measured per-row rate predicts, and never before straggler_after_s.
    request_timeout_s: float = 30.0  # the deadline cap
    straggler_after_s: float = 10.0  # the fixed allowance (queueing, prefill) and the earliest hedge
    straggler_factor: float = 2.0
    max_attempts: int = 4  # per request, across servers
    weight_push_timeout_s: float = 600.0  # a server's load of a new version (tens of GB on a cluster)
    max_inflight_requests: int = 16  # per rollout server
    # Rollout base URLs (a local run fills them in); `dns+http://<service>:<port>` follows every address of a
    # headless Service, so autoscaled rollout pods join and leave without a restart.
    endpoints: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.max_staleness < 0:
            fail("max_staleness", self.max_staleness, "must be >= 0 (0 = synchronous)")
        for name in ("request_timeout_s", "straggler_after_s", "weight_push_timeout_s"):
            if getattr(self, name) <= 0:
                fail(name, getattr(self, name), "must be > 0 seconds")
        if not self.straggler_factor >= 1:
            fail("straggler_factor", self.straggler_factor, "must be >= 1 (a request is a straggler once it runs "
                 "longer than expected by this factor)")
        for name in ("max_attempts", "max_inflight_requests"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")


@dataclass(frozen=True)
class WeightStoreConfig:
    """Where each published weight version goes. `local` and `fs` are the same atomic directory store (`fs` on a
    shared filesystem such as FSx for Lustre); `s3` publishes shards first and the manifest last."""

    kind: Literal["local", "fs", "s3"] = "local"
    path: str | None = None  # local/fs: the directory (default: <output_dir>/weights)
    bucket: str | None = None  # s3
    prefix: str = "weights"  # s3 key prefix
    endpoint_url: str | None = None  # s3: a non-AWS endpoint (tests use moto's server on 127.0.0.1)
    keep_versions: int = 3  # older versions are deleted after a newer one is published
    # A rollout server on its trainer's GPU (a local GPU run, RunConfig.weights_over_device) takes each version
    # from the trainer's GPU memory (CUDA IPC) instead of reading it from the store, which is still written
    # (restarts, other machines, the record of versions). False: through the store alone.
    device_transfer: bool = True

    def validate(self) -> None:
        if self.kind == "s3" and not self.bucket:
            fail("bucket", self.bucket, "an s3 weight store needs a bucket")
        if self.kind == "fs" and not self.path:
            fail("path", self.path, "an fs weight store needs the shared filesystem path")
        if self.keep_versions < 2:
            fail("keep_versions", self.keep_versions, "must be >= 2 (readers may still load the previous one)")


@dataclass(frozen=True)
class RoutingStoreConfig:
    """Where rollout servers put the routed experts of each choice when routing replay is on, and trainer ranks
    read them (workloads/rl/routing_store.py): a directory every server and trainer pod reaches (on a cluster,
    under the FSx volume). The wire carries only a reference to each (protocol.RoutingRef)."""

    path: str | None = None  # default: <output_dir>/routing
    # "none": the raw ids (FSx moves GB/s; zlib's level 1 runs at a fraction of that and expert ids shrink little);
    # "zlib": smaller files for a slow shared filesystem (workloads/BENCHMARKS-rl.md, bench-routing)
    compression: Literal["none", "zlib"] = "none"
    # A file no orchestrator state refers to (a hedge's losing answer, an answer whose caller gave up or crashed)
    # is deleted once this old: longer than any answer takes from the server to the orchestrator's buffer.
    orphan_after_s: float = 900.0

    def directory(self, output_dir: str) -> str:
        """The store's directory for a run whose output is `output_dir` (formatted: {name} filled in)."""
        return self.path or f"{output_dir.rstrip('/')}/routing"

    def validate(self) -> None:
        if self.path is not None and not self.path:
            fail("path", self.path, "a directory, or omitted for <output_dir>/routing")
        if self.orphan_after_s <= 0:
            fail("orphan_after_s", self.orphan_after_s, "must be > 0 seconds")


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = 100
    prompts_per_step: int = 16  # groups per optimizer step (before dynamic sampling)
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    # AdamW's moment decay rates. A lower beta2 (0.95, as OpenRLHF and most LLM pre-training use) lets the second
    # moment follow a gradient that grows suddenly, e.g. an expert the router starts sending tokens to, instead of
    # dividing it by the small gradients of the last ~1,000 steps (workloads/BENCHMARKS-rl.md, bench-rl).
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    seed: int = 0
    warmup_sft_steps: int = 0  # supervised steps on well-formed (not necessarily correct) answers, before RL
    warmup_learning_rate: float = 1e-2
    checkpoint_every: int = 10  # steps; a SIGTERM also writes one
    router_bias_update_rate: float = 1e-3  # sigmoid router: aux-loss-free balancing step per RL step; 0 = frozen
    init_from: str | None = None  # a Hugging Face Qwen3-MoE checkpoint directory to start from; default: seeded init
    output_dir: str = "runs/{name}"  # metrics, TensorBoard, checkpoints, plots; {name} = run name
    # Tokens (prompt + completion - 1 per sample) one forward/backward holds; a rank's share of a mini-batch is
    # packed into micro-batches of at most this many tokens and their gradients accumulated.
    max_tokens_per_microbatch: int = 16384
    # Recompute decoder layers in the backward: "full" keeps each layer's input only, "save_attention" also the
    # attention kernel's output (no attention recomputation: 4.5 % faster at 8 x 8k tokens of Qwen3's shape on an
    # H200, same peak memory; workloads/BENCHMARKS.md).
    activation_checkpointing: Literal["off", "full", "save_attention"] = "save_attention"
    # FSDP2 of the dense (non-expert) weights, their gradients and AdamW state over the trainer's ranks (the
    # experts stay split by expert parallelism); default: replicated on every rank. PPO's critic stays replicated
    # (workloads/trainer/critic.py says why).
    fsdp: bool = False
    # Ranks the routed experts are split over (expert parallelism); default: every trainer rank. Fewer (a divisor
    # of the ranks, >= 2; num_experts divisible by the ranks) needs fsdp: consecutive ranks form an EP group (a
    # node's GPUs keep the all-to-all on NVLink) and each expert's copies, one per group, are sharded by FSDP2
    # over the groups, so every rank still holds 1/ranks of the experts' weights, gradients and AdamW state.
    expert_parallel: int | None = None
    # The dtype FSDP gathers parameters in, for the layers to compute with (fsdp only): "bfloat16" halves the
    # all-gathers and the gathered layers; the float32 shards stay the master weights AdamW steps, and gradients
    # are reduced in float32. "float32": gathered as stored; on GPUs the trainer's bf16 autocast casts per op.
    fsdp_param_dtype: Literal["float32", "bfloat16"] = "float32"
    # Context parallelism: this many consecutive trainer ranks share each packed micro-batch, each running a
    # contiguous slice of its tokens, attention made whole by an all-to-all over heads (DeepSpeed-Ulysses:
    # workloads/model/context_parallel.py says why). Must divide the trainer's ranks and the query heads; a sample
    # may then be up to this many times longer than one rank's activations hold. 1 = off.
    context_parallel: int = 1
    # Learning rate per optimizer step (steps x epochs x mini-batches of them): linear warm-up from 0 over
    # lr_warmup_steps, then constant or cosine down to min_learning_rate at the last optimizer step.
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = 0
    min_learning_rate: float = 0.0

    def output_directory(self, run_name: str) -> str:
        """`output_dir` with {name} filled in: where every role finds the run's files."""
        return self.output_dir.format(name=run_name)

    def validate(self) -> None:
        for name in ("steps", "prompts_per_step", "checkpoint_every", "max_tokens_per_microbatch", "context_parallel"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        if self.expert_parallel is not None and self.expert_parallel < 2:
            fail("expert_parallel", self.expert_parallel, "must be >= 2 (ranks per EP group), or unset for every rank")
        if self.fsdp_param_dtype != "float32" and not self.fsdp:
            fail("fsdp_param_dtype", self.fsdp_param_dtype, "is FSDP's gathered dtype: turn rl.training.fsdp on")
        if self.lr_warmup_steps < 0:
            fail("lr_warmup_steps", self.lr_warmup_steps, "must be >= 0 (optimizer steps)")
        if not 0 <= self.min_learning_rate <= self.learning_rate:
            fail("min_learning_rate", self.min_learning_rate,
                 f"must be between 0 and learning_rate ({self.learning_rate})")
        for name in ("learning_rate", "warmup_learning_rate"):
            if getattr(self, name) <= 0:
                fail(name, getattr(self, name), "must be > 0")
        if self.warmup_sft_steps < 0:
            fail("warmup_sft_steps", self.warmup_sft_steps, "must be >= 0")
        if self.router_bias_update_rate < 0:
            fail("router_bias_update_rate", self.router_bias_update_rate, "must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 0 and < 1")


@dataclass(frozen=True)
class RLConfig:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    weights: WeightStoreConfig = field(default_factory=WeightStoreConfig)
    routing: RoutingStoreConfig = field(default_factory=RoutingStoreConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    # Shared secret for the rollout servers' weight-load endpoint, read from this environment variable.
    weight_token_env: str = "MOERL_WEIGHT_TOKEN"

    @property
    def policy_optimizer_steps(self) -> int:
        """The policy's optimizer steps in the run (its learning-rate schedule's length): the RL steps after the
        critic's warm-up, each epochs_per_batch x mini_batches of them."""
        a = self.algorithm
        return (self.training.steps - a.critic_warmup_steps) * a.epochs_per_batch * a.mini_batches

    def validate(self) -> None:
        if self.data.builtin and (self.task.name == "countdown") != (self.reward.function == "countdown"):
            fail("reward.function", self.reward.function, f"the built-in {self.task.name} task is scored by its own "
                 f"reward: use reward.function: {self.task.name}")
        if self.data.builtin and self.task.name == "countdown":
            longest = self.task.longest_countdown_tokens()
            if self.sampling.max_tokens < longest:
                fail("sampling.max_tokens", self.sampling.max_tokens,
                     f"must be >= {longest}, the longest countdown completion at task.max_steps "
                     f"{self.task.max_steps} (end-of-sequence included): a cut completion can never be fully correct")
        if self.data.builtin and self.task.name == "random_tokens":
            if self.task.prompt_tokens > self.sampling.max_prompt_tokens:
                fail("task.prompt_tokens", self.task.prompt_tokens,
                     f"must be <= rl.sampling.max_prompt_tokens ({self.sampling.max_prompt_tokens})")
            if self.task.mean_completion_tokens >= self.sampling.max_tokens:
                fail("task.mean_completion_tokens", self.task.mean_completion_tokens,
                     f"must be < rl.sampling.max_tokens ({self.sampling.max_tokens}), the lengths' cap")
        longest = self.sampling.max_prompt_tokens + self.sampling.max_tokens - 1
        if self.training.max_tokens_per_microbatch < longest:
            fail("training.max_tokens_per_microbatch", self.training.max_tokens_per_microbatch,
                 f"must be >= the longest sample, rl.sampling.max_prompt_tokens + max_tokens - 1 ({longest}): a "
                 "sequence is never split across micro-batches")
        if self.algorithm.critic_warmup_steps >= self.training.steps:
            fail("algorithm.critic_warmup_steps", self.algorithm.critic_warmup_steps,
                 f"must be < rl.training.steps ({self.training.steps}): the policy must train for at least one step")
        optimizer_steps = self.policy_optimizer_steps
        if self.training.lr_warmup_steps > optimizer_steps:
            fail("training.lr_warmup_steps", self.training.lr_warmup_steps,
                 f"must be <= the run's policy optimizer steps ((steps - algorithm.critic_warmup_steps) x "
                 f"epochs_per_batch x mini_batches = {optimizer_steps})")
        samples = self.training.prompts_per_step * self.algorithm.group_size
        if self.algorithm.mini_batches > samples:
            fail("algorithm.mini_batches", self.algorithm.mini_batches,
                 f"must be <= rl.training.prompts_per_step x rl.algorithm.group_size ({samples} samples per step)")
        if not self.data.builtin and self.sampling.tokenizer == "builtin":
            fail("sampling.tokenizer", self.sampling.tokenizer, "a dataset (rl.data.train) needs the model's "
                 "tokenizer: a Hugging Face model directory or a tokenizer.json")
