"""Trainer: `torchrun` ranks with expert parallelism inside. Each step: rank 0 fetches the step's batch from the
orchestrator and broadcasts it; every rank trains on its share (non-expert gradients summed across ranks, expert
gradients already whole through the all-to-all), steps the optimizer, and the ranks gather the full weights that
rank 0 publishes as the next version. Checkpoints every `checkpoint_every` steps and on SIGTERM (preemption), then
exits cleanly; a restart resumes from the newest checkpoint.

The trainer knows nothing of the algorithm beyond per-token advantages and masks (GRPO advantages come from the
orchestrator)."""
from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import signal
import statistics
import tempfile
import time
import urllib.error
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl_eks.core import metrics as M
from moe_rl_eks.core.cluster import TRAINER_METRICS_PORT
from moe_rl_eks.core.run import RunConfig, resolve_run

from ..model import MoETransformer
from ..model.checkpoint import load_hf, save_hf
from ..model.transformer import expert_slice, weights_dtype
from ..moe.parallel import ExpertParallel, local_experts
from . import checkpoint as ckpt
from .algorithms import gae, terminal_rewards
from .losses import PolicyBatch, policy_loss, token_logprobs_and_entropy, value_loss
from .rewards import ArithmeticTask
from .runtime import Registry, http_json, load, output_dir, run_argparser
from .tokenizer import load_tokenizer
from .weights import open_store

log = logging.getLogger(__name__)
EXPERT_MARK = ".mlp.experts."


@dataclass
class Tensors:
    inputs: torch.Tensor  # [B, S] prompt + completion[:-1], right-padded
    targets: torch.Tensor  # [B, S]
    mask: torch.Tensor  # [B, S] 1 on completion targets
    behaviour: torch.Tensor  # [B, S] rollout logprobs on completion targets
    advantages: torch.Tensor  # [B, S]
    routing: list[torch.Tensor] | None  # per layer [B, S, k]
    valid: torch.Tensor  # [B, S] bool: real tokens (not right padding)

    def to(self, device: torch.device) -> "Tensors":
        move = [r.to(device) for r in self.routing] if self.routing is not None else None
        return Tensors(self.inputs.to(device), self.targets.to(device), self.mask.to(device),
                       self.behaviour.to(device), self.advantages.to(device), move, self.valid.to(device))


def to_tensors(samples: list[dict], completions_key: str = "completion_ids") -> Tensors:
    """Right-padded training tensors; causal attention means padding after a sequence never changes it."""
    seqs = [s["prompt_ids"] + s[completions_key] for s in samples]
    width = max(len(q) for q in seqs) - 1
    b = len(samples)
    inputs, targets = torch.zeros(b, width, dtype=torch.long), torch.zeros(b, width, dtype=torch.long)
    mask, behaviour, adv = torch.zeros(b, width), torch.zeros(b, width), torch.zeros(b, width)
    valid = torch.zeros(b, width, dtype=torch.bool)
    routing = None
    if samples and "routing" in samples[0]:
        layers, k = len(samples[0]["routing"]), len(samples[0]["routing"][0][0])
        routing = [torch.zeros(b, width, k, dtype=torch.long) for _ in range(layers)]
    for i, (s, q) in enumerate(zip(samples, seqs)):
        n, p = len(q) - 1, len(s["prompt_ids"])
        inputs[i, :n], targets[i, :n] = torch.tensor(q[:-1]), torch.tensor(q[1:])
        valid[i, :n] = True
        mask[i, p - 1:n] = 1.0
        if "logprobs" in s:
            behaviour[i, p - 1:n] = torch.tensor(s["logprobs"])
        adv[i, p - 1:n] = s.get("advantage", 0.0)
        if routing is not None:
            for layer, ids in enumerate(s["routing"]):
                routing[layer][i, :n] = torch.tensor(ids)
    return Tensors(inputs, targets, mask, behaviour, adv, routing, valid)


class Trainer:
    def __init__(self, run: RunConfig, orchestrator: str | None, rank: int, world: int) -> None:
        self.run, self.orchestrator, self.rank, self.world = run, orchestrator, rank, world
        self.cfg, self.algo = run.rl.training, run.rl.algorithm
        self.out = output_dir(run)
        self.ckpt_root = self.out / "checkpoints"
        self.store = open_store(run.rl.weights, self.out / "weights")
        backend = resolved_backend(run)
        self.device = train_device()
        self.ep = (ExpertParallel(dist.group.WORLD, backend, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                                  device=str(self.device)) if world > 1 else None)
        torch.manual_seed(self.cfg.seed)
        state = initial_weights(run, local_experts(self.ep, run.model.num_experts))
        self.model = MoETransformer(run.model, ep=self.ep, compute=run.moe_compute)
        self.model.load_state_dict(state)
        self.model.to(self.device)
        # PPO's critic: a linear value head on the final hidden state (captured by a hook on the final norm),
        # replicated like every non-expert weight. It is not part of the published policy.
        self.value_head: torch.nn.Linear | None = None
        self._hidden: list[torch.Tensor] = []
        if self.algo.name == "ppo":
            self.value_head = torch.nn.Linear(run.model.hidden_size, 1)
            # Zero-initialised: an untrained critic predicts 0 rather than inventing advantages.
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            self.value_head.to(self.device)
            self.model.model.norm.register_forward_hook(lambda mod, args, out: self._hidden.append(out))
        head = list(self.value_head.parameters()) if self.value_head is not None else []
        # Everything the optimizer steps; the value head is replicated like every non-expert weight.
        self.trained = torch.nn.ModuleList([self.model, *([self.value_head] if self.value_head is not None else [])])
        self.expert_params = [p for n, p in self.model.named_parameters() if EXPERT_MARK in n]
        self.shared_params = [p for n, p in self.model.named_parameters() if EXPERT_MARK not in n] + head
        self.optimizer = torch.optim.AdamW([*self.model.parameters(), *head], lr=self.cfg.learning_rate,
                                           weight_decay=self.cfg.weight_decay)
        self.reference: MoETransformer | None = None
        self.step, self.stop_requested = 0, False
        self.wait_seconds, self.started = 0.0, time.monotonic()
        self.samples_trained = 0
        self.writer = None
        self.last_metrics: dict[str, float] = {}
        self.prometheus = Registry()

    # ---- gradients across ranks ---------------------------------------------------------------------------
    def _sync_and_clip(self) -> float:
        """Sum replicated parameters' gradients over ranks (each rank's loss is already divided by the global
        token count); expert gradients arrive whole through the all-to-all. Then clip by the global norm."""
        if self.ep is not None:
            self.ep.sum_replicated_grads(self.trained)
        shared_sq = sum(p.grad.float().square().sum() for p in self.shared_params if p.grad is not None)
        expert_sq = sum(p.grad.float().square().sum() for p in self.expert_params if p.grad is not None)
        expert_sq = torch.as_tensor(expert_sq, dtype=torch.float32, device=self.device)
        if self.world > 1:
            dist.all_reduce(expert_sq)  # each rank holds other experts; replicated weights are equal everywhere
        norm = float(torch.sqrt(expert_sq + shared_sq))
        scale = min(1.0, self.cfg.grad_clip / (norm + 1e-6))
        if scale < 1.0:
            for p in self.trained.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def _gather(self, value: float) -> list[float]:
        if self.world == 1:
            return [value]
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [float(x) for x in out]

    def _global(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        return float(t)

    def _logprobs(self, model: MoETransformer, t: Tensors, temperature: float, replay: bool):
        self._hidden.clear()  # the value head's hook keeps only this forward's final hidden state
        # The mask keeps right padding out of the expert load and balance loss (it never reaches real tokens:
        # attention is causal).
        # bf16 mixed precision on GPUs (float32 master weights and optimizer); float32 on the CPU.
        bf16 = self.device.type == "cuda" and self.run.model.dtype == "bfloat16"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(t.inputs, routing_replay=t.routing if replay else None, attention_mask=t.valid)
        logp, entropy = token_logprobs_and_entropy(out.logits.float() / temperature, t.targets)
        return logp, entropy, out.aux_loss, out.expert_load

    # ---- the two kinds of step ----------------------------------------------------------------------------
    def sft_step(self, index: int) -> float:
        """Warm-up: cross-entropy on well-formed answers with random values (teaches the format, not the task)."""
        task, tok = ArithmeticTask(self.run.rl.task, self.cfg.seed + 1), load_tokenizer(self.run.rl.sampling.tokenizer)
        n = self.cfg.prompts_per_step * self.algo.group_size
        samples = []
        for j in range(index * n, (index + 1) * n):
            answer = task.well_formed_example(j)
            samples.append({"prompt_ids": tok.encode(task.problem(j).prompt),
                            "completion_ids": _without_bos(tok, tok.encode(answer)) + [tok.eos_id]})
        t = to_tensors(samples[self.rank::self.world]).to(self.device)
        tokens = self._global(float(t.mask.sum()))
        logp, _, aux, _ = self._logprobs(self.model, t, 1.0, replay=False)
        loss = -(logp * t.mask).sum() / tokens + aux / self.world
        loss.backward()
        self._sync_and_clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._global(float(loss.detach()))

    def rl_step(self, batch: dict) -> dict:
        samples = batch["samples"][self.rank::self.world]
        t = to_tensors(samples).to(self.device)
        tokens = self._global(float(t.mask.sum()))  # a collective: every rank starts its step clock here
        started = time.monotonic()
        temperature = self.run.rl.sampling.temperature
        replay = self.algo.routing_replay
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference = self._logprobs(self.reference, t, temperature, replay)[0]
        proximal = old_values = returns = None
        advantages = t.advantages  # GRPO: from the orchestrator
        metrics: dict[str, float] = {}
        for epoch in range(self.algo.epochs_per_batch):
            logp, entropy, aux, load = self._logprobs(self.model, t, temperature, replay)
            if proximal is None:
                proximal = logp.detach()  # the policy before this step's first update
                first_load = load
            values = None
            if self.value_head is not None:
                # Detached: the critic reads the policy's features but its loss does not reshape the policy.
                values = self.value_head(self._hidden[-1].detach().float()).squeeze(-1)
                if old_values is None:  # PPO: GAE on the values before this step's first update
                    old_values = values.detach()
                    rewards = torch.tensor([s["reward"] for s in samples], device=self.device)
                    advantages, returns = gae(terminal_rewards(rewards, t.mask), old_values, t.mask,
                                              gamma=self.algo.gamma, lam=self.algo.gae_lambda)
            pb = PolicyBatch(logp, proximal, t.behaviour, advantages, t.mask, reference, entropy)
            loss, metrics = policy_loss(pb, self.algo, num_tokens=tokens)
            if values is not None:
                v_loss = value_loss(values, old_values, returns, t.mask, self.algo.value_clip, num_tokens=tokens)
                loss = loss + self.algo.value_coef * v_loss
                metrics["value_loss"] = float(v_loss.detach())
            loss = loss + aux / self.world
            loss.backward()
            arrived = time.monotonic() - started  # this rank's arrival at the gradient all-reduce
            metrics = {k: self._global(v) for k, v in metrics.items()}  # each is a sum over tokens / global count
            if epoch == 0:
                stragglers = straggler_ratio(self._gather(arrived))
            metrics["grad_norm"] = self._sync_and_clip()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            metrics["loss"] = self._global(float(loss.detach()))
        metrics["tokens"] = tokens
        metrics["straggler_ratio"] = stragglers
        load = first_load.float()  # this rank's tokens, routed by the policy the batch started from
        if self.world > 1:
            dist.all_reduce(load)
        metrics["expert_load_imbalance"] = expert_load_imbalance(load)
        rate = self.cfg.router_bias_update_rate
        if self.run.model.router == "sigmoid" and rate > 0:
            # DeepSeek-V3's auxiliary-loss-free balancing; the biases ship with every published version, so
            # rollout servers keep choosing experts as the trainer does.
            self.model.update_routing_bias(load, rate=rate)
        return metrics

    # ---- weights, checkpoints -----------------------------------------------------------------------------
    def publish(self, version: int) -> None:
        start = time.monotonic()
        # Published in the model's serving dtype; the trainer keeps float32 master weights.
        state = self.model.gather_state(weights_dtype(self.run.model))  # collective; the state on rank 0 only
        if self.rank == 0:
            with tempfile.TemporaryDirectory(dir=self.out) as staging:
                save_hf(state, self.run.model, staging)
                self.store.publish(version, Path(staging))
            seconds = time.monotonic() - start
            self.last_metrics[M.WEIGHT_PUBLISH_SECONDS.name] = seconds
            if self.orchestrator:
                http_json("POST", f"{self.orchestrator}/v1/version", {"version": version}, timeout=300)
            log.info("published version %d in %.2f s", version, seconds)

    def save_checkpoint(self) -> None:
        staging = ckpt.staging_dir(self.ckpt_root, self.step)
        if self.rank == 0:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir()
        if self.world > 1:
            dist.barrier()
        ckpt.write_rank(self.ckpt_root, self.step, self.rank, self._trained_state(), self.optimizer.state_dict())
        if self.world > 1:
            dist.barrier()
        if self.rank == 0:
            orch_state = http_json("GET", f"{self.orchestrator}/v1/state", timeout=60) if self.orchestrator else None
            meta = {"step": self.step, "version": self.step, "world": self.world,
                    "samples_trained": self.samples_trained}
            path = ckpt.commit(self.ckpt_root, self.step, meta, orch_state)
            log.info("checkpoint %s", path)
        if self.world > 1:
            dist.barrier()

    def _trained_state(self) -> dict:
        state = self.model.state_dict()
        if self.value_head is not None:
            state.update({f"value_head.{k}": v for k, v in self.value_head.state_dict().items()})
        return state

    def try_resume(self) -> bool:
        directory = ckpt.latest(self.ckpt_root)
        if directory is None:
            return False
        meta = json.loads((directory / "trainer.json").read_text())
        if meta["world"] != self.world:
            raise SystemExit(f"checkpoint {directory} was written by {meta['world']} ranks; this run has {self.world}")
        state = ckpt.read_rank(directory, self.rank)
        model_state = dict(state["model"])
        if self.value_head is not None:
            self.value_head.load_state_dict({k.removeprefix("value_head."): model_state.pop(k)
                                             for k in list(model_state) if k.startswith("value_head.")})
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(state["optimizer"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.samples_trained = meta["step"], meta["samples_trained"]
        log.info("resumed from %s at step %d", directory, self.step)
        return True

    # ---- the loop -----------------------------------------------------------------------------------------
    def fetch_batch(self) -> dict | None:
        """Rank 0 long-polls the orchestrator; every rank gets the batch, or None when stopping."""
        box: list = [None]
        if self.rank == 0:
            start = time.monotonic()
            committed = self.step - self.step % self.cfg.checkpoint_every
            while not self.stop_requested:
                try:
                    batch = http_json("GET", f"{self.orchestrator}/v1/batch?step={self.step}&committed={committed}",
                                      timeout=60)
                except urllib.error.HTTPError as exc:
                    if exc.code < 500:  # the orchestrator refused this trainer's request: retrying cannot help
                        raise RuntimeError(f"orchestrator refused the batch request: {exc.code} {exc.read()!r}") from exc
                    log.warning("orchestrator error (%s); retrying", exc)
                    time.sleep(1)
                    continue
                except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                    log.warning("orchestrator unreachable (%s); retrying", exc)
                    time.sleep(1)
                    continue
                if batch.get("samples"):
                    box[0] = batch
                    break
            self.wait_seconds += time.monotonic() - start
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def run_loop(self) -> int:
        if not self.try_resume():
            self._save_eval_weights("initial")
            self._set_lr(self.cfg.warmup_learning_rate)
            for i in range(self.cfg.warmup_sft_steps):
                loss = self.sft_step(i)
                if self.rank == 0:
                    log.info("warm-up step %d/%d loss %.3f", i + 1, self.cfg.warmup_sft_steps, loss)
            self._set_lr(self.cfg.learning_rate)
            self._save_eval_weights("warmup")
        if self.algo.kl_coef > 0:
            # The reference is the policy RL started from (after warm-up), also when resuming mid-run.
            self.reference = MoETransformer(self.run.model, ep=self.ep, compute=self.run.moe_compute)
            self.reference.load_full_state_dict(load_hf(self.out / "eval" / "warmup")[1])
            self.reference.to(self.device)
            self.reference.requires_grad_(False)
        self.publish(self.step)
        if self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.out / "tensorboard"))
        while self.step < self.cfg.steps:
            batch = self.fetch_batch()
            if batch is None:
                break
            start = time.monotonic()
            metrics = self.rl_step(batch)
            self.step += 1
            self.samples_trained += len(batch["samples"])
            self.publish(self.step)
            step_seconds = time.monotonic() - start
            if self.rank == 0:
                self._record(batch, metrics, step_seconds)
            if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                self.save_checkpoint()
        if self.stop_requested and self.step < self.cfg.steps:
            log.info("SIGTERM: checkpointing at step %d and exiting", self.step)
            self.save_checkpoint()
        if self.rank == 0 and self.writer:
            self.writer.close()
        return 0

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _save_eval_weights(self, name: str) -> None:
        """Keep the weights at a milestone (initial, after warm-up) for evaluation after the run."""
        state = self.model.gather_state()  # collective; the state on rank 0 only
        if self.rank == 0:
            save_hf(state, self.run.model, self.out / "eval" / name)
        if self.world > 1:
            dist.barrier()  # other ranks read the warm-up weights as their KL reference

    def _record(self, batch: dict, metrics: dict, step_seconds: float) -> None:
        wall = time.monotonic() - self.started
        stats = batch["stats"]
        row = {"step": self.step, "version": self.step, "time": time.time(), "wall_seconds": wall,
               "reward_mean": stats["reward_mean"], "accuracy": stats["accuracy"],
               "staleness_mean": stats["staleness_mean"], "samples": len(batch["samples"]),
               "samples_per_second": self.samples_trained / wall, "step_seconds": step_seconds,
               "trainer_idle_fraction": self.wait_seconds / wall,
               "dropped_stale_groups": stats["dropped_stale_groups"], "retries": stats["retries"],
               "reward_failures": stats["reward_failures"], **metrics, **self.last_metrics}
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        with open(self.out / "trained.jsonl", "a") as f:
            f.write(json.dumps({"step": batch["step"], "ids": [s["id"] for s in batch["samples"]]}) + "\n")
        for key, value in row.items():
            if isinstance(value, (int, float)) and key not in ("step", "time"):
                self.writer.add_scalar(key, value, self.step)
        self.writer.flush()
        for metric, value in ((M.TRAINER_STEP_SECONDS, step_seconds), (M.TRAINER_LAST_STEP_TIMESTAMP, row["time"]),
                              (M.TRAINER_TOKENS_PER_SECOND, metrics["tokens"] / max(step_seconds, 1e-9)),
                              (M.TRAINER_IDLE_FRACTION, row["trainer_idle_fraction"]),
                              (M.STRAGGLER_RATIO, metrics["straggler_ratio"]),
                              (M.EXPERT_LOAD_IMBALANCE, metrics["expert_load_imbalance"]),
                              (M.REWARD_MEAN, row["reward_mean"]), (M.SAMPLE_STALENESS, row["staleness_mean"]),
                              (M.WEIGHT_PUBLISH_SECONDS, self.last_metrics.get(M.WEIGHT_PUBLISH_SECONDS.name, 0.0))):
            self.prometheus[metric].set(value)


def initial_weights(run: RunConfig, experts: range | None = None) -> dict[str, torch.Tensor]:
    """The state the run starts from, with only `experts` (this rank's slice; None: all): `rl.training.init_from`
    (a pretrained checkpoint, which must have the run's architecture; only the slice is read from disk) or a
    seeded random initialisation of the whole model, then sliced, so the weights do not depend on the ranks."""
    source = run.rl.training.init_from
    if source is None:
        return expert_slice(MoETransformer(run.model).state_dict(), experts)
    config, state = load_hf(source, experts=experts)
    ignored = {"dtype", "router_aux_loss_coef"}  # how the run trains, not what the checkpoint holds
    for f in fields(config):
        if f.name not in ignored and getattr(config, f.name) != getattr(run.model, f.name):
            raise ValueError(f"rl.training.init_from: {source} has {f.name}={getattr(config, f.name)!r} but the "
                             f"run's model.{f.name} is {getattr(run.model, f.name)!r}; make the model section match "
                             f"the checkpoint's config.json")
    return state


def _without_bos(tok, ids: list[int]) -> list[int]:
    """A completion continues its prompt: drop the BOS a tokenizer puts in front of every encoded text."""
    return ids[1:] if tok.bos_id is not None and ids[:1] == [tok.bos_id] else ids


def expert_load_imbalance(load: torch.Tensor) -> float:
    """Worst layer's busiest expert over its mean load ([L, E] counts summed over ranks); 1.0 = balanced."""
    per_layer = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)
    return float(per_layer.max())


def straggler_ratio(arrival_seconds: list[float]) -> float:
    """Slowest rank's time to reach the gradient all-reduce over the median rank's: 1.0 when balanced. Ranks
    that arrive early wait there for the slowest, so arrival (not step time, equal on all ranks) shows it."""
    return max(arrival_seconds) / max(statistics.median(arrival_seconds), 1e-9)


def train_device() -> torch.device:
    """This rank's GPU (torchrun's LOCAL_RANK), or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def resolved_backend(run: RunConfig) -> str:
    """The run's EP backend, resolved against its environment (the cdk.json shipped with the pod), logged with
    its reason; it must equal what the manifests were written with ($MOERL_EP_BACKEND), else the two drifted."""
    env = None
    if run.environment is not None:
        from moe_rl_eks.core.environment import load_cdk_json, select_environment

        env = select_environment(load_cdk_json(os.environ.get("MOERL_CDK_JSON", "cdk.json")), run.environment)
    resolved = resolve_run(run, env)
    expected = os.environ.get("MOERL_EP_BACKEND")
    if expected and expected != resolved.ep_backend:
        raise RuntimeError(f"ep backend: the manifests were written for {expected!r} but this run resolves to "
                           f"{resolved.ep_backend!r} against its environment; regenerate the manifests")
    log.info("ep backend %s: %s", resolved.ep_backend, resolved.ep_backend_reason)
    return resolved.ep_backend


def main(argv: list[str]) -> int:
    parser = run_argparser("train", "train a run (start under torchrun)")
    parser.add_argument("--orchestrator", default=os.environ.get("MOERL_ORCHESTRATOR"),
                        help="orchestrator base URL (default: $MOERL_ORCHESTRATOR)")
    parser.add_argument("--metrics-port", type=int, default=TRAINER_METRICS_PORT,
                        help="Prometheus /metrics of each node's first rank; 0 = none")
    args = parser.parse_args(argv)
    run = load(args.run)
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(train_device())
    # Ranks other than 0 wait in a broadcast while rank 0 polls the orchestrator for a batch; the first batch on a
    # cluster (servers loading tens of GB, then generating) can take longer than the 10-minute NCCL default.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(run, args.orchestrator, rank, world)
    trainer.out.mkdir(parents=True, exist_ok=True)
    if args.metrics_port and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        from prometheus_client import start_http_server
        start_http_server(args.metrics_port, registry=trainer.prometheus.registry)

    def on_sigterm(signum, frame):  # Kubernetes preemption: finish the step, checkpoint, exit 0
        trainer.stop_requested = True
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return trainer.run_loop()
    finally:
        dist.destroy_process_group()
