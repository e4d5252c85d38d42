"""A synchronous on-policy RL run in one process, for the benches and tests that compare algorithms by what they
learn (bench-ppo, tests/rl/test_critic.py): the real Trainer and its loop (warm-up, critic warm-up, checkpoints,
metrics.jsonl), fed by `OnPolicyBatches`, which does what the orchestrator does in a max_staleness 0 run without
HTTP or rollout servers: each step's prompts from the run's prompt source, `group_size` completions each sampled
from the trainer's current weights by the rollout engine's decoder with seeds derived from (run seed, prompt
index), scored by the run's reward, sequence advantages by the run's algorithm."""
from __future__ import annotations

import statistics
from pathlib import Path

import torch

from moe_rl_eks.workloads.orchestrator.evaluation import completion_text
from moe_rl_eks.workloads.rl.data import make_prompt_source
from moe_rl_eks.workloads.rl.protocol import (Batch, BatchStats, TrainingSample, VersionRef, derive_seed,
                                              one_version)
from moe_rl_eks.workloads.rl.rewards import RewardScorer
from moe_rl_eks.workloads.rl.runtime import read_jsonl
from moe_rl_eks.workloads.rl.tokenizer import load_tokenizer
from moe_rl_eks.workloads.rollout.decoder import decode_all
from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
from moe_rl_eks.workloads.trainer.loop import Trainer


class OnPolicyBatches:
    """A trainer's BatchSource (trainer/orchestrator_link.py) sampling from that trainer's own weights."""

    def __init__(self, run) -> None:
        self.run = run
        self.tokenizer = load_tokenizer(run.rl.sampling.tokenizer)
        self.prompts = make_prompt_source(run, self.tokenizer)
        self.scorer = RewardScorer(run.rl.reward)
        self.trainer: Trainer | None = None

    def next_batch(self, step: int, committed: int, stopping) -> Batch | None:
        rl, trainer = self.run.rl, self.trainer
        n = rl.algorithm.group_size
        prompts = [self.prompts.next() for _ in range(rl.training.prompts_per_step)]
        requests = [RowRequest(p.prompt_ids, SamplingParams(rl.sampling.max_tokens, rl.sampling.temperature,
                                                            seed=derive_seed(rl.training.seed, p.index)),
                               str(p.index), j) for p in prompts for j in range(n)]
        outs = decode_all(trainer.model, requests, self.tokenizer.eos_ids)
        finished = [o.finish_reason == "stop" for o in outs]
        results = self.scorer.score_many([(prompts[i // n], completion_text(self.tokenizer, o.token_ids, f), f)
                                          for i, (o, f) in enumerate(zip(outs, finished))])
        rewards = torch.tensor([r.score for r in results]).view(len(prompts), n)
        advantages = trainer.algorithm.sequence_advantages(rewards).reshape(-1).tolist()
        version = VersionRef(trainer.lineage, step)
        samples = [TrainingSample(f"{o.request_id}/{o.row}", list(prompts[i // n].prompt_ids), o.token_ids, o.logprobs,
                                  float(rewards.view(-1)[i]), advantages[i], finished[i],
                                  one_version(version, len(o.token_ids)))
                   for i, o in enumerate(outs)]
        correct = float((rewards >= rl.reward.pass_threshold).float().mean())
        return Batch(step, trainer.lineage, samples,
                     BatchStats(float(rewards.mean()), correct, 0.0, 0, 0, 0, 0, len(samples)))

    def version_published(self, version: int, lineage: int) -> None:
        pass

    def state(self) -> dict | None:
        return None


def train(run) -> tuple[list[dict], Trainer]:
    """Run `run` through the trainer's loop on on-policy batches: its metrics.jsonl rows, and the trainer."""
    source = OnPolicyBatches(run)
    trainer = Trainer(run, source, rank=0, world=1)
    source.trainer = trainer
    trainer.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    assert trainer.run_loop() == 0
    return read_jsonl(Path(trainer.out / "metrics.jsonl")), trainer


def mean_reward(rows: list[dict], last: int) -> float:
    """The mean batch reward of the last `last` steps: on-policy samples of the weights of those steps."""
    return statistics.fmean(r["reward_mean"] for r in rows[-last:])
