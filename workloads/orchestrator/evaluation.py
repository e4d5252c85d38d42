"""Evaluation of a policy on the evaluation split (or fresh built-in problems): mean reward, pass@1 and pass@k
(the unbiased estimator of Chen et al. 2021 over n samples per prompt), mean response length, truncation rate and
failed rewards; optionally per data source.

`evaluate` takes a `Complete` function (prompts, n, params -> n samples per prompt), so the same code scores a run's
rollout servers over HTTP (`http_completer`), a model in this process (tools/evaluate.py: `moerl eval` and the
local run's evaluation of checkpoints), or anything else that samples. Metrics are plain floats named `eval/...`;
`record` appends them to `eval.jsonl` and TensorBoard, which the reward plot reads.

A failed reward is masked here as in training: the sample is left out of the reward mean and of its prompt's
pass@k (a prompt with fewer than k scored samples is left out of pass@k), and counted in `eval/rewards_failed`.

Torch-free: the orchestrator imports it."""
from __future__ import annotations

import json
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..rl.data import Prompt
from ..rl.rewards import RewardScorer
from ..rl.runtime import read_jsonl

log = logging.getLogger(__name__)
PREFIX = "eval/"
PROMPTS_PER_CALL = 16  # prompts handed to `complete` at once: bounds memory of a local model's batch


@dataclass(frozen=True)
class EvalSample:
    text: str  # decoded completion without its stop token
    tokens: int  # completion length in tokens, stop token included
    finished: bool  # ended with a stop token (False: cut at max_tokens)
    version: int | None = None  # the weight version that sampled it, when a server says (HTTP)


@dataclass(frozen=True)
class EvalParams:
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int  # the run's seed: sample j of prompt i draws from derive_seed(seed, EVAL_STREAM, i) row j


Complete = Callable[[list[Prompt], EvalParams], list[list[EvalSample]]]
EVAL_STREAM = 0x6576616C  # "eval": keeps evaluation seeds apart from the training prompts' derive_seed(seed, i)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct:
    1 - C(n-c, k) / C(n, k), as a product so large n does not overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


Scored = tuple[Prompt, list[EvalSample], list[float | None]]  # a prompt, its samples and their rewards


def score_prompts(prompts: list[Prompt], complete: Complete, scorer: RewardScorer, params: EvalParams, *,
                  prompts_per_call: int = PROMPTS_PER_CALL) -> list[Scored]:
    """Sample `params.n` completions per prompt, `prompts_per_call` prompts at a time, and score them."""
    if not prompts:
        raise ValueError("no evaluation prompts (rl.data.eval is unset or every prompt is too long)")
    k = params.n
    per_prompt: list[Scored] = []
    for start in range(0, len(prompts), prompts_per_call):
        chunk = prompts[start:start + prompts_per_call]
        samples = complete(chunk, params)
        if len(samples) != len(chunk) or any(len(s) != k for s in samples):
            raise ValueError(f"the completer returned {[len(s) for s in samples]} samples for {len(chunk)} prompts "
                             f"x n={k}")
        results = scorer.score_many([(p, s.text, s.finished) for p, group in zip(chunk, samples) for s in group])
        for i, (p, group) in enumerate(zip(chunk, samples)):
            per_prompt.append((p, group, [r.score for r in results[i * k:(i + 1) * k]]))
    return per_prompt


def summarise(per_prompt: list[Scored], k: int, pass_threshold: float, by_source: bool = True) -> dict[str, float]:
    """The metrics of scored prompts (see the module docstring), per data source too when there are several."""
    metrics = _summary(per_prompt, k, pass_threshold)
    sources = sorted({p.data_source for p, _, _ in per_prompt})
    if by_source and len(sources) > 1:
        for source in sources:
            part = _summary([x for x in per_prompt if x[0].data_source == source], k, pass_threshold)
            metrics.update({f"{PREFIX}{source}/{name[len(PREFIX):]}": v for name, v in part.items()})
    return metrics


def evaluate(prompts: list[Prompt], complete: Complete, scorer: RewardScorer, params: EvalParams, *,
             pass_threshold: float, by_source: bool = True) -> dict[str, float]:
    """Sample, score and summarise."""
    return summarise(score_prompts(prompts, complete, scorer, params), params.n, pass_threshold, by_source)


def prompt_mean_rewards(per_prompt: list[Scored]) -> list[float]:
    """Each prompt's mean reward over its scored samples (NaN where none scored): the unit of a paired comparison
    of two policies on the same prompts."""
    means = []
    for _, _, scores in per_prompt:
        got = [s for s in scores if s is not None]
        means.append(sum(got) / len(got) if got else math.nan)
    return means


def _summary(per_prompt, k: int, threshold: float) -> dict[str, float]:
    scores = [s for _, _, group in per_prompt for s in group if s is not None]
    samples = [s for _, group, _ in per_prompt for s in group]
    pass1, passk = [], []
    for _, _, group in per_prompt:
        scored = [s for s in group if s is not None]
        correct = sum(s >= threshold for s in scored)
        if scored:
            pass1.append(pass_at_k(len(scored), correct, 1))
        if len(scored) >= k:
            passk.append(pass_at_k(len(scored), correct, k))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    versions = [s.version for s in samples if s.version is not None]
    sampled_with = ({f"{PREFIX}weight_version_min": float(min(versions)), f"{PREFIX}weight_version_max":
                     float(max(versions))} if versions else {})
    return {**sampled_with, f"{PREFIX}reward_mean": mean(scores), f"{PREFIX}pass@1": mean(pass1),
            f"{PREFIX}pass@{k}": mean(passk), f"{PREFIX}response_tokens_mean": mean([s.tokens for s in samples]),
            f"{PREFIX}truncation_rate": mean([0.0 if s.finished else 1.0 for s in samples]),
            f"{PREFIX}rewards_failed": float(len(samples) - len(scores)), f"{PREFIX}prompts": float(len(per_prompt))}


def params_for(run, n: int | None = None) -> EvalParams:
    e = run.rl.evaluation
    return EvalParams(n=n or e.samples_per_prompt, max_tokens=e.max_tokens or run.rl.sampling.max_tokens,
                      temperature=e.temperature, top_p=run.rl.sampling.top_p, seed=run.rl.training.seed)


def evaluate_run(run, complete: Complete, tokenizer, scorer: RewardScorer | None = None,
                 prompts: list[Prompt] | None = None) -> dict[str, float]:
    """A run's evaluation (rl.evaluation) on its evaluation prompts; what the orchestrator calls every N steps.
    Pass `prompts` (data.evaluation_prompts, computed once) so a dataset in S3 is not read again each time."""
    from ..rl.data import evaluation_prompts

    own = scorer is None
    scorer = scorer or RewardScorer(run.rl.reward)
    try:
        return evaluate(evaluation_prompts(run, tokenizer) if prompts is None else prompts, complete, scorer,
                        params_for(run), pass_threshold=run.rl.reward.pass_threshold)
    finally:
        if own:
            scorer.close()


def completion_text(tokenizer, tokens: list[int], finished: bool) -> str:
    """A sample's text: its tokens decoded without the stop token that ended it."""
    return tokenizer.decode(tokens[:-1] if finished else tokens)


def http_completer(url: str, tokenizer, *, model: str | None = None, timeout_s: float = 600,
                   concurrency: int = 8) -> Complete:
    """Samples from a rollout server (POST {url}/v1/completions with token ids), one request per prompt with
    n = params.n, `concurrency` requests at once."""
    import urllib.request

    from ..rl.openai_api import CompletionRequest, read_completion
    from ..rl.protocol import derive_seed

    def one(prompt: Prompt, params: EvalParams) -> list[EvalSample]:
        body = CompletionRequest(prompt=list(prompt.prompt_ids), n=params.n, max_tokens=params.max_tokens,
                                 temperature=params.temperature, top_p=params.top_p, model=model,
                                 seed=derive_seed(params.seed, EVAL_STREAM, prompt.index), logprobs=0).to_json()
        req = urllib.request.Request(f"{url.rstrip('/')}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            completion = read_completion(json.load(resp))
        choices = sorted(completion.choices, key=lambda c: c.index)
        return [EvalSample(completion_text(tokenizer, c.token_ids, c.finish_reason == "stop"), len(c.token_ids),
                       c.finish_reason == "stop", completion.version.version) for c in choices]

    def complete(prompts: list[Prompt], params: EvalParams) -> list[list[EvalSample]]:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: one(p, params), prompts))
    return complete


class ScalarWriter:
    """TensorBoard scalars without torch (the orchestrator's image has none): tensorboard's own event writer,
    one event file of its own in the run's TensorBoard directory, next to the trainer's."""

    def __init__(self, logdir: str | Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(logdir), filename_suffix=".eval")

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        import time

        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._writer.add_event(Event(wall_time=time.time(), step=step,
                                     summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def record(out_dir: str | Path, step: int, metrics: dict[str, float], writer=None) -> None:
    """Append {"step", metrics...} to <out_dir>/eval.jsonl; with a TensorBoard writer (add_scalar), each scalar."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "eval.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
    if writer is not None:
        for name, value in metrics.items():
            writer.add_scalar(name, value, step)
        writer.flush()


class PeriodicEvaluator:
    """A run's evaluation every rl.evaluation.every_steps, through a rollout server over HTTP, in a background
    thread so rollouts and training go on meanwhile; results go to <out_dir>/eval.jsonl and TensorBoard.

    One evaluation at a time: a step that comes due while one runs is skipped (counted in `skipped`). The
    evaluation samples whatever version the server holds while it runs: the step's, or newer ones when the
    orchestrator moves the server on meanwhile; eval/weight_version_min and _max record which it sampled.
    Locking: `_lock` guards `_thread` and `skipped`; the thread alone touches the prompts, scorer and writer."""

    def __init__(self, run, out_dir: str | Path, tokenizer) -> None:
        self.run, self.out_dir, self.tokenizer = run, Path(out_dir), tokenizer
        self.every = run.rl.evaluation.every_steps
        self.skipped = 0
        self._prompts: list[Prompt] | None = None
        self._scorer: RewardScorer | None = None
        self._writer: ScalarWriter | None = None
        self._thread = None
        self._lock = threading.Lock()

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def maybe_start(self, step: int, server_url: str) -> bool:
        """Start step `step`'s evaluation on `server_url` if it is due and none is running."""
        if not self.due(step):
            return False
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self.skipped += 1
                return False
            self._thread = threading.Thread(target=self._evaluate, args=(step, server_url), daemon=True,
                                            name=f"evaluation-{step}")
            self._thread.start()
        return True

    def _evaluate(self, step: int, server_url: str) -> None:
        from ..rl.data import evaluation_prompts

        try:
            if self._prompts is None:
                self._prompts = evaluation_prompts(self.run, self.tokenizer)
                self._scorer = RewardScorer(self.run.rl.reward)
                self._writer = ScalarWriter(self.out_dir / "tensorboard")
            complete = http_completer(server_url, self.tokenizer, model=self.run.name)
            metrics = evaluate_run(self.run, complete, self.tokenizer, self._scorer, self._prompts)
            record(self.out_dir, step, metrics, self._writer)
            log.info("evaluation at step %d: %s", step, {k: round(v, 4) for k, v in metrics.items()})
        except Exception:  # noqa: BLE001 -- an evaluation that fails must not stop the run; it is logged
            log.exception("evaluation at step %d failed", step)

    def wait(self, timeout: float | None = None) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def close(self) -> None:
        self.wait()
        if self._scorer is not None:
            self._scorer.close()
        if self._writer is not None:
            self._writer.close()


def read_records(out_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(out_dir) / "eval.jsonl")
