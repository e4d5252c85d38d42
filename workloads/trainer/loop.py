"""Trainer: `torchrun` ranks with expert parallelism inside. The loop (this module): rank 0 fetches the step's
batch from the orchestrator (a `BatchSource`, orchestrator_link.py) and broadcasts it (routing replay's arrays are
not in it: each rank reads its own samples' from the routing store); every rank trains on its share, rank 0 publishes
the weights as the next version; checkpoints every `checkpoint_every` steps and on SIGTERM (preemption: the ranks
agree on stopping every step, so all of them checkpoint together), then exits cleanly; a restart resumes from the
newest checkpoint in a new weight lineage.

The step itself is step.TrainStep (tensors to loss, gradient sync, clipping, one collective of metrics); the
algorithm (advantages, normalizer, loss, epochs x mini-batches) is the run's `Algorithm` object, asked, never
branched on."""
from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import signal
import statistics
import time
from dataclasses import fields, replace

import torch
import torch.distributed as dist

from moe_rl_eks.core import metrics as M
from moe_rl_eks.core.cluster import TRAINER_METRICS_PORT
from moe_rl_eks.core.run import RunConfig, resolve_run
from moe_rl_eks.core.schema import ConfigError

from ..model import MoETransformer
from ..model.checkpoint import load_hf, save_hf
from ..model.context_parallel import ContextParallel
from ..model.parallelize import (ParallelPlan, check_layout, expert_tensor, gather_state, load_full_state, parallelize,
                                 unsharded_state)
from ..model.transformer import expert_slice
from ..moe.parallel import ExpertParallel, local_experts
from ..rl.algorithms import SequenceScores, explained_variance, make_algorithm
from ..rl.checkpoint_dirs import latest
from ..rl.data import FormatExamples
from ..rl.device_weights import DeviceExporter, channel as device_channel
from ..rl.losses import PolicyBatch, Totals
from ..rl.protocol import Batch, RoutingRef, TrainingSample, VersionRef, one_version
from ..rl.routing_store import RoutingStore
from ..rl.runtime import Registry, cap_gpu_memory, load, output_dir, run_argparser
from ..rl.tokenizer import load_tokenizer, write_checkpoint_metadata
from ..rl.weights import open_store
from . import checkpoint as ckpt
from .orchestrator_link import Announcer, BatchSource, HttpBatchSource
from .microbatch import Sequences, plan_microbatches, rank_shares, sequence_tokens
from .numerics import ExactScorer, MismatchTally, values_with_gradient
from .publisher import Publisher
from .critic import Critic, fit_on_stored
from .step import Forward, TrainStep, learning_rate

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, run: RunConfig, source: BatchSource | None, rank: int, world: int) -> None:
        self.run, self.source, self.rank, self.world = run, source, rank, world
        self.cfg = run.rl.training
        if world % self.cfg.context_parallel:
            raise ConfigError(f"run {run.name!r}", "rl.training.context_parallel", self.cfg.context_parallel,
                              f"must divide the trainer's {world} ranks")
        self.algorithm = make_algorithm(run.rl)
        self.out = output_dir(run)
        self.ckpt_root = self.out / "checkpoints"
        self.store = open_store(run.rl.weights, self.out / "weights")
        self.device = train_device()
        self.plan = ParallelPlan(ep_degree=self.cfg.expert_parallel or world, ep_backend=resolved_backend(run),
                                 ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)), fsdp=self.cfg.fsdp,
                                 activation_checkpointing=self.cfg.activation_checkpointing, compute=run.moe_compute,
                                 cp_degree=self.cfg.context_parallel, param_dtype=self.cfg.fsdp_param_dtype)
        try:
            check_layout(self.plan, world, run.model.num_experts)
        except ValueError as exc:
            raise ConfigError(f"run {run.name!r}", "rl.training.expert_parallel", self.cfg.expert_parallel,
                              f"{exc} (the trainer has {world} ranks)") from None
        # One data-parallel dimension over every rank; the experts are split over the same ranks (EP degree =
        # world) or over groups of rl.training.expert_parallel ranks, the dense weights replicated or, with
        # rl.training.fsdp, sharded (model/parallelize.py).
        self.mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.device.type, (world,), mesh_dim_names=("dp",))
        torch.manual_seed(self.cfg.seed)
        self.model, self.ep = self._build_model(self.plan)
        load_full_state(self.model, initial_weights(run, local_experts(self.ep, run.model.num_experts)))
        # PPO's critic (critic.py: what it reads and why), replicated on every rank, in its own AdamW group.
        self.critic: Critic | None = None
        groups: list[dict] = [{"params": list(self.model.parameters())}]
        if self.algorithm.needs_values:
            self.critic = Critic(run.model.hidden_size, run.rl.sampling.max_tokens).to(self.device)
            groups.append({"params": list(self.critic.parameters()), "lr": run.rl.algorithm.critic_lr})
        # fused on GPUs: the foreach form makes temporaries the size of all gradients
        self.optimizer = torch.optim.AdamW(groups, lr=self.cfg.learning_rate,
                                           betas=(self.cfg.adam_beta1, self.cfg.adam_beta2),
                                           weight_decay=self.cfg.weight_decay, fused=self.device.type == "cuda")
        # bf16 mixed precision on GPUs (float32 master weights and optimizer); float32 on the CPU.
        bf16 = self.device.type == "cuda" and run.model.dtype == "bfloat16"
        # numerics: exact scores with the engine's kernels on a served-dtype copy, loaded at every publication
        exact = ExactScorer(self.model, self.device) if run.numerics == "exact" else None
        self.train_step = TrainStep(self.model, self.critic, self.optimizer, ep=self.ep, world=world, rank=rank,
                                    device=self.device, grad_clip=self.cfg.grad_clip, bf16=bf16, exact=exact)
        self.reference: MoETransformer | None = None
        self._format_examples: FormatExamples | None = None  # the warm-up's pairs, made at its first step
        # Several ranks write checkpoints over a gloo group of their own: DCP's background thread runs its
        # collectives (plans, metadata) while this thread runs training's, and on the default group's gloo backend
        # (every collective on the CPU; object broadcasts and barriers beside NCCL) the two threads' calls would
        # meet in a different order on each rank. One rank has no peer to disagree with: the default group serves.
        self.checkpoint_group = dist.new_group(backend="gloo") if world > 1 else None
        self._pending_checkpoint = None
        self.publisher: Publisher | None = None
        self.announcer: Announcer | None = None
        self.exporter: DeviceExporter | None = None  # versions to a rollout server on this GPU, by device memory
        self.step, self.committed_step, self.lineage, self.stop_requested = 0, 0, 0, False
        self.wait_seconds, self.started = 0.0, time.monotonic()
        self.samples_trained = 0
        self.writer = None
        self.last_metrics: dict[str, float] = {}
        self.prometheus = Registry()
        self.routing_store = RoutingStore.of(run, self.prometheus)  # routing replay: this rank's samples' experts

    def _build_model(self, plan: ParallelPlan, ep: ExpertParallel | None = None,
                     cp: ContextParallel | None = None) -> tuple[MoETransformer, ExpertParallel | None]:
        """The model laid out by `plan`, uninitialised on this rank's device: built on the meta device and
        parallelized there, so no rank allocates the experts it does not own. `ep`, `cp`: the policy's groups,
        which its reference shares."""
        with torch.device("meta"):
            model = MoETransformer(self.run.model, compute=plan.compute)
        ep = parallelize(model, self.mesh, plan, ep=ep, cp=cp)
        return model.to_empty(device=self.device), ep

    # ---- batches as micro-batches -------------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=op)
        return t

    def _plan(self, seqs: Sequences, parts: list[list[int]]) -> list[list[list[int]]]:
        """Per part (mini-batch), the rows of each micro-batch; every rank gets the same number of micro-batches
        per part (the most any rank needs; the others run empty ones), since each forward is an EP collective."""
        lengths = seqs.lengths
        plans = [[[rows[i] for i in mb] for mb in plan_microbatches([lengths[r] for r in rows],
                                                                   self.cfg.max_tokens_per_microbatch)]
                 for rows in parts]
        most = self._all_reduce(torch.tensor([len(p) for p in plans], device=self.device), dist.ReduceOp.MAX)
        return [plan + [[]] * (int(n) - len(plan)) for plan, n in zip(plans, most.tolist())]

    def _totals(self, seqs: Sequences, parts: list[list[int]]) -> torch.Tensor:
        """[parts, 3] float64 over every rank: completion tokens, sequences with one, all real tokens (a CP
        group's ranks hold the same samples: counted once)."""
        local = []
        for rows in parts:
            part = seqs.select(rows)
            local.append(torch.cat([Totals.local(part.mask), part.valid.sum().reshape(1).double()]))
        return self._batch_sum(torch.stack(local).to(self.device) if local else torch.zeros(0, 3, device=self.device))

    def _batch_sum(self, t: torch.Tensor) -> torch.Tensor:
        """A sum over the batch of what each rank holds of it: over every rank, a CP group's samples counted once."""
        self._all_reduce(t)
        if self.cfg.context_parallel > 1:
            t /= self.cfg.context_parallel
        return t

    def _share(self, samples: list) -> list:
        """This rank's samples of a batch: shares balanced by tokens across the data-parallel groups
        (microbatch.rank_shares); the ranks of a context-parallel group share theirs."""
        cp = self.cfg.context_parallel
        share = rank_shares([sequence_tokens(s) for s in samples], self.world // cp)[self.rank // cp]
        return [samples[i] for i in share]

    # ---- the two kinds of step ----------------------------------------------------------------------------
    def sft_step(self, index: int) -> float:
        """Warm-up: cross-entropy on answers of the right shape that are not the prompt's (data.FormatExamples:
        teaches the format, not the task), on the run's own prompts (built-in task or dataset)."""
        if self._format_examples is None:
            self._format_examples = FormatExamples(self.run, load_tokenizer(self.run.rl.sampling.tokenizer))
        n = self.cfg.prompts_per_step * self.run.rl.algorithm.group_size
        samples = [TrainingSample(f"sft/{index * n + i}", list(prompt), completion, [0.0] * len(completion), 0.0,
                                  0.0, True, one_version(VersionRef(0, 0), len(completion)))
                   for i, (prompt, completion) in enumerate(self._format_examples.pairs(index * n, n))]
        seqs = Sequences.of(self._share(samples)).to(self.device)
        rows = list(range(len(seqs.lengths)))
        (plan,) = self._plan(seqs, [rows])
        tokens, _, real = self._totals(seqs, [rows])[0].tolist()

        def loss_fn(j: int, mb: Sequences, fwd: Forward):
            loss = -(fwd.logprobs * mb.mask).sum() / max(tokens, 1.0)
            return loss + fwd.aux_loss * (sum(mb.lengths) / max(real, 1.0)), {}

        metrics = self.train_step.step([seqs.select(r) for r in plan], loss_fn, lr=self.cfg.warmup_learning_rate,
                                       temperature=1.0, replay=False)
        return metrics["loss"]

    def rl_step(self, batch: Batch) -> dict:
        """Train on one batch: this rank's share, split into the algorithm's mini-batches, each packed into
        micro-batches; epochs x mini-batches optimizer steps. The policy, reference and critic are scored once
        before the first update (the proximal policy of every mini-batch is the batch's starting policy, so
        later mini-batches' ratios move and the clip constrains them). During the critic's warm-up (PPO's first
        rl.algorithm.critic_warmup_steps steps) only the critic is trained, on the value loss; after the batch's
        steps, rl.algorithm.critic_epochs more passes fit the critic alone on its inputs of the last pass."""
        algo, e_count, m_count = self.algorithm, self.algorithm.epochs, self.algorithm.mini_batches
        critic_epochs, critic_lr = self.run.rl.algorithm.critic_epochs, self.run.rl.algorithm.critic_lr
        warming_critic = self.step < self.run.rl.algorithm.critic_warmup_steps
        temperature, replay = self.run.rl.sampling.temperature, self.run.rl.algorithm.routing_replay
        seqs = Sequences.of(self._share(batch.samples), self._read_routing if replay else None).to(self.device)
        rows = list(range(len(seqs.lengths)))
        parts = [rows[m::m_count] for m in range(m_count)]
        plans = self._plan(seqs, parts)
        totals = self._totals(seqs, parts)
        started = time.monotonic()
        # Before any update: the proximal policy (needed once a batch takes several optimizer steps), the critic's
        # values (PPO's advantages), the reference.
        proximal = reference = old_values = None
        score_policy = algo.needs_values or e_count * m_count > 1
        if score_policy or self.reference is not None:
            proximal, old_values, reference = self._score(seqs, plans, score_policy, temperature, replay)
        scored = time.monotonic()
        advantages, returns = algo.token_advantages(SequenceScores(seqs.rewards, seqs.advantages, seqs.mask),
                                                    old_values, self._batch_sum if self.world > 1 else None)

        def cut(full: torch.Tensor | None, rows: list[int], width: int) -> torch.Tensor | None:
            return None if full is None else full[rows, :width]

        steps, first_load, arrivals, kept = [], None, None, []
        mismatch = MismatchTally(self.device)  # behaviour vs the starting policy's logprobs, each token once
        for epoch in range(e_count):
            for m in range(m_count):
                part_tokens, part_sequences, part_real = totals[m].tolist()
                if part_tokens == 0:  # no rank has a completion token in this mini-batch: nothing to step
                    continue
                part_totals = Totals.of(totals[m, :2])
                microbatches = [seqs.select(r) for r in plans[m]]

                # the first step's policy is the published one: its current logprobs may be the exact scorer's,
                # which the proximal scoring has already made (then the step takes them from there, with its own
                # forward's gradient) or the step's own forward makes
                exact_first = not steps and self.train_step.exact is not None
                reuse = exact_first and proximal is not None

                def loss_fn(j: int, mb: Sequences, fwd: Forward, rows=plans[m], reuse=reuse):
                    r, w = rows[j], mb.mask.shape[1]
                    logprobs = values_with_gradient(cut(proximal, r, w), fwd.logprobs) if reuse else fwd.logprobs
                    pb = PolicyBatch(logprobs, cut(proximal, r, w) if proximal is not None else fwd.logprobs.detach(),
                                     mb.behaviour, cut(advantages, r, w), mb.mask, cut(reference, r, w), fwd.entropy,
                                     fwd.values, cut(old_values, r, w), cut(returns, r, w))
                    if epoch == 0:
                        mismatch.add(pb.proximal_logprobs, mb.behaviour, mb.mask)
                    if warming_critic:
                        return algo.critic_loss(fwd.values, pb.old_values, pb.returns, mb.mask, part_totals)
                    loss, metrics = algo.loss(pb, part_totals)
                    # the balance loss as a token-weighted mean over the step's micro-batches and ranks
                    return loss + fwd.aux_loss * (sum(mb.lengths) / part_real), metrics

                # the policy's schedule runs over its own optimizer steps: from the end of the critic's warm-up
                policy_step = self.step - self.run.rl.algorithm.critic_warmup_steps
                lr = (0.0 if warming_critic else
                      learning_rate(self.cfg, (policy_step * e_count + epoch) * m_count + m,
                                    self.run.rl.policy_optimizer_steps))
                result = self.train_step.step(microbatches, loss_fn, lr=lr, temperature=temperature, replay=replay,
                                              critic_lr=critic_lr, train_policy=not warming_critic,
                                              exact_values=exact_first and not reuse,
                                              keep_critic_inputs=critic_epochs > 0 and epoch == e_count - 1)
                if epoch == 0:
                    first_load = result["expert_load"] if first_load is None else first_load + result["expert_load"]
                    arrivals = arrivals or result["arrivals"]
                steps.append(result)
                if "critic_inputs" in result:
                    kept.append((m, (microbatches, result.pop("critic_inputs"))))

        def critic_step(m: int, stored: tuple) -> dict:
            def loss_fn(j: int, mb: Sequences, values: torch.Tensor, rows=plans[m]):
                r, w = rows[j], mb.mask.shape[1]
                return algo.critic_loss(values, cut(old_values, r, w), cut(returns, r, w), mb.mask,
                                        Totals.of(totals[m, :2]))
            return self.train_step.critic_step(*stored, loss_fn, critic_lr=critic_lr)

        fits = fit_on_stored(critic_step, kept, critic_epochs)
        metrics = {k: statistics.fmean(r[k] for r in steps) for k in steps[0] if k not in ("arrivals", "expert_load")}
        metrics.update(mismatch.metrics(self._batch_sum, lambda t: self._all_reduce(t, dist.ReduceOp.MAX)))
        metrics["optimizer_steps"] = len(steps)
        if returns is not None:
            # of the values the advantages came from: the critic before it saw this batch, so a held-out measure
            metrics["critic_explained_variance"] = explained_variance(
                old_values, returns, seqs.mask, self._batch_sum if self.world > 1 else None)
            metrics["critic_warmup"] = float(warming_critic)
        if fits:  # the value loss before each step of the last fitting pass (each on its mini-batch)
            metrics["critic_fit_value_loss"] = statistics.fmean(f["value_loss"] for f in fits[-len(kept):])
        metrics["tokens"] = float(totals[:, 0].sum())
        metrics["straggler_ratio"] = straggler_ratio(arrivals)
        metrics["expert_load_imbalance"] = expert_load_imbalance(first_load)
        metrics["step_compute_seconds"] = time.monotonic() - started
        metrics["score_seconds"] = scored - started  # the logprob scoring before the first update (0: none needed)
        rate = self.cfg.router_bias_update_rate
        if self.run.model.router == "sigmoid" and rate > 0 and not warming_critic:
            # DeepSeek-V3's auxiliary-loss-free balancing from the load of the policy the batch started from
            # (every rank's tokens); the biases ship with every published version, so rollout servers keep
            # choosing experts as the trainer does.
            self.model.update_routing_bias(first_load.to(self.device), rate=rate)
        return metrics

    def _read_routing(self, ref: RoutingRef, path: str):
        """A sample's routed experts from the routing store (this rank's samples only: rl_step reads its share)."""
        return self.routing_store.read(ref, path, self.run.model)

    @torch.no_grad()
    def _score(self, seqs: Sequences, plans: list[list[list[int]]], policy: bool, temperature: float, replay: bool):
        """(proximal logprobs, critic values, reference logprobs), each [B, S] over this rank's samples or None."""
        shape = seqs.mask.shape
        proximal = torch.zeros(shape, device=self.device) if policy else None
        values = torch.zeros(shape, device=self.device) if policy and self.critic is not None else None
        reference = torch.zeros(shape, device=self.device) if self.reference is not None else None
        for rows in (r for plan in plans for r in plan):
            mb = seqs.select(rows)
            w = mb.mask.shape[1]
            if policy:
                proximal[rows, :w], value = self.train_step.score(mb, temperature=temperature, replay=replay,
                                                                  values=values is not None)
                if values is not None:
                    values[rows, :w] = value
            if reference is not None:
                reference[rows, :w] = self.train_step.forward(self.reference, mb, temperature=temperature,
                                                              replay=replay).logprobs
        if reference is not None and self.plan.fsdp and self.world > 1:
            # FSDP keeps a root's weights gathered after its forward, for the backward that follows; the
            # reference has none, so its embedding and lm_head go back to their shards.
            self.reference.reshard()
        return proximal, values, reference

    # ---- weights, checkpoints -----------------------------------------------------------------------------
    def start_publishing(self) -> None:
        """Pick this run's weight lineage and start the background publisher (every rank writes its experts).
        The lineage is 0 in an empty store, else one past the store's newest: a restart from a checkpoint never
        reuses the dead lineage's version numbers, and LATEST (which only moves forward) follows the new run."""
        box = [self.store.latest() if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        self.lineage = 0 if box[0] is None else box[0].lineage + 1
        # Each version is a complete Hugging Face checkpoint: tokenizer files and generation_config.json beside the
        # weights, so evaluation and other tools can load it as it is.
        self.publisher = Publisher(self.store, self.run.model, self.lineage, ep=self.ep,
                                   extra_files=functools.partial(write_checkpoint_metadata, run=self.run))
        channel = device_channel(self.run) if self.world == 1 else None
        if channel is not None:
            try:
                self.exporter = DeviceExporter(self.run.model, *channel)
            except OSError as exc:  # its address taken (an earlier trainer of this run still exiting): the store
                log.warning("weight versions go through the store only: the device channel is unavailable (%s)", exc)
        if self.rank == 0 and self.source is not None:
            self.announcer = Announcer(self.publisher, self.source, self.lineage,
                                       background=self.run.rl.orchestrator.max_staleness > 0)
        log.info("publishing weights as lineage %d", self.lineage)

    def publish(self, version: int) -> None:
        """Snapshot the weights as `version` (returns once they are in host memory; written in the background)
        and announce it to the batch source (Announcer: when the store has it, or sooner over device memory)."""
        # FSDP: all-gathered on every rank, kept by rank 0 (the publisher writes the dense weights from there) and,
        # in the exact numerics mode, by every rank: each one's exact scorer holds the dense weights whole
        state = unsharded_state(self.model, keep_dense=self.rank == 0 or self.train_step.exact is not None)
        self.publisher.publish(version, state)
        if self.train_step.exact is not None:  # the next batch is scored with exactly these weights
            self.train_step.exact.load(state)
        seconds = self.publisher.snapshot_seconds
        # Before the announcement: the server on this GPU finds the version offered.
        offered = self.exporter is not None and self.exporter.export(VersionRef(self.lineage, version), state)
        if offered:
            seconds += self.exporter.export_seconds
        self.last_metrics[M.WEIGHT_PUBLISH_SECONDS.name] = seconds
        if self.announcer is not None:
            self.announcer.published(version, offered=offered)

    def stop_publishing(self) -> None:
        """Write the newest version, announce it, stop the writer."""
        self.publisher.close()
        if self.announcer is not None:
            self.announcer.close()
        if self.exporter is not None:
            self.exporter.close()

    def save_checkpoint(self) -> None:
        """Start writing a checkpoint of this step (every rank) and return; the one before is committed first.
        The write runs in the background (DCP async_save: the tensors are copied to host memory before it
        returns), off the step's critical path; `poll_checkpoint` commits it once complete."""
        self.poll_checkpoint(wait=True)
        staging = ckpt.prepare(self.ckpt_root, self.step, self.rank, self.world)
        self._ensure_optimizer_state()
        future = ckpt.save(self._checkpoint_state(), staging, asynchronous=True, group=self.checkpoint_group)
        meta = {"step": self.step, "version": self.step, "lineage": self.lineage, "world": self.world,
                "samples_trained": self.samples_trained, "python_rng": ckpt.python_rng_state()}
        # the orchestrator's state as of this step, fetched now (it moves on while the write runs)
        source_state = self.source.state() if self.rank == 0 and self.source is not None else None
        self._pending_checkpoint = (future, self.step, meta, source_state)

    def poll_checkpoint(self, *, wait: bool) -> None:
        """Commit the checkpoint being written once it is complete (rank 0; waiting for it if `wait`). On rank 0
        a finished write means every rank's shards and the metadata are on disk (DCP finishes there last)."""
        if self._pending_checkpoint is None:
            return
        future, step, meta, source_state = self._pending_checkpoint
        if not wait and not future.done():
            return
        self._pending_checkpoint = None
        future.result()
        if self.rank == 0:
            log.info("checkpoint %s", ckpt.commit(self.ckpt_root, step, meta, source_state))
        self.committed_step = step

    def _trained_state(self) -> dict[str, torch.Tensor]:
        """Weights and buffers of what the optimizer trains (the policy; PPO's critic), by name."""
        state = dict(self.model.state_dict(keep_vars=True))
        if self.critic is not None:
            state.update({f"critic.{k}": v for k, v in self.critic.state_dict(keep_vars=True).items()})
        return state

    def _ensure_optimizer_state(self) -> None:
        """AdamW's state exists for every trained parameter (it is made lazily at the first step), so a checkpoint
        always has the same entries and a fresh trainer has tensors to load them into. Made where AdamW makes it:
        the step count on the parameter's device when fused (the fused CUDA kernel refuses a CPU one), else on the
        CPU."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if not self.optimizer.state[p]:
                    self.optimizer.state[p] = {"step": torch.tensor(0.0, device=p.device if group["fused"] else "cpu"),
                                               "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def _checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Flat DCP state, sharing storage with the live tensors: weights, AdamW moments and step counts, the
        torch RNG. Under EP the experts and their moments are DTensors sharded over the ranks along the expert
        dimension, so a run with another number of ranks reads its own slices."""
        state: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
        weights = self._trained_state()
        by_param = {id(t): name for name, t in weights.items()}
        for name, tensor in weights.items():
            state[f"model.{name}"] = self._shard(name, tensor.detach())
        for p, entries in self.optimizer.state.items():
            name = by_param[id(p)]
            for key, value in entries.items():
                state[f"optim.{name}.{key}"] = self._shard(name, value) if value.dim() else value
        return state

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """As DCP should see it: FSDP's shards are DTensors already; an expert slice (or its FSDP shard) becomes
        one of every expert (parallelize.expert_tensor); a replicated tensor stays whole, and DCP writes it once."""
        if self.world == 1 or ".mlp.experts." not in name:
            return tensor
        return expert_tensor(tensor, self.ep, self.mesh)

    def try_resume(self) -> bool:
        """Load the newest committed checkpoint (written by any number of ranks) and continue in a new lineage."""
        directory = latest(self.ckpt_root)
        if directory is None:
            return False
        meta = ckpt.read_meta(directory, critic=self.critic is not None)
        self._ensure_optimizer_state()
        state = self._checkpoint_state()
        ckpt.load(state, directory)
        torch.set_rng_state(state["rng.torch"])
        ckpt.set_python_rng_state(meta["python_rng"])
        self.step, self.samples_trained = meta["step"], meta["samples_trained"]
        self.committed_step = self.step
        log.info("resumed from %s (written by %d ranks) at step %d", directory, meta["world"], self.step)
        return True

    # ---- the loop -----------------------------------------------------------------------------------------
    def fetch_batch(self) -> Batch | None:
        """Rank 0 waits for the step's batch; every rank gets it, or None when rank 0 is stopping."""
        box: list = [None]
        if self.rank == 0:
            start = time.monotonic()
            # the newest checkpoint that is committed (not merely started: they are written in the background),
            # so the source keeps every batch a restart could ask for again
            box[0] = self.source.next_batch(self.step, self.committed_step, lambda: self.stop_requested)
            self.wait_seconds += time.monotonic() - start
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def stop_agreed(self) -> bool:
        """Whether any rank was asked to stop (SIGTERM reaches ranks one by one, or only some): decided together
        every step, so every rank checkpoints and exits at the same step."""
        flag = torch.tensor([float(self.stop_requested)], dtype=torch.float64, device=self.device)
        return bool(self._all_reduce(flag, dist.ReduceOp.MAX).item())

    def run_loop(self) -> int:
        resumed = self.try_resume()
        self.start_publishing()
        snapshots = eval_snapshots(self.run, self.algorithm.needs_reference)
        if not resumed:
            if "initial" in snapshots:
                self._save_eval_weights("initial")
            for i in range(self.cfg.warmup_sft_steps):
                loss = self.sft_step(i)
                if self.rank == 0:
                    log.info("warm-up step %d/%d loss %.3f", i + 1, self.cfg.warmup_sft_steps, loss)
            if "warmup" in snapshots:
                self._save_eval_weights("warmup")
        if self.algorithm.needs_reference:
            self.load_reference()  # the policy RL started from (after warm-up), also when resuming mid-run
        self.publish(self.step)
        if self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter
            # Written by the writer's own thread every few seconds: a flush per step would make the step wait for it.
            self.writer = SummaryWriter(str(self.out / "tensorboard"), flush_secs=5)
        stopping = False
        while self.step < self.cfg.steps:
            self.poll_checkpoint(wait=False)
            stopping = self.stop_agreed()
            if stopping:
                break
            batch = self.fetch_batch()
            if batch is None:
                stopping = True
                break
            start = time.monotonic()
            metrics = self.rl_step(batch)
            self.step += 1
            self.samples_trained += len(batch.samples)
            self.publish(self.step)
            step_seconds = time.monotonic() - start
            if self.rank == 0:
                self._record(batch, metrics, step_seconds)
            if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                self.save_checkpoint()
        if stopping and self.step % self.cfg.checkpoint_every:
            log.info("SIGTERM: checkpointing at step %d and exiting", self.step)
            self.save_checkpoint()
        self.poll_checkpoint(wait=True)
        self.stop_publishing()
        if self.rank == 0 and self.writer:
            self.writer.close()
        if self.world > 1:
            # A rank whose checkpoint part is written returns while rank 0 may still finish the checkpoint over
            # the checkpoint group; tearing the groups down under it aborted a gloo rank at the last step's
            # checkpoint (seen once in a clean-clone `make test`). Every rank leaves together.
            dist.barrier()
        return 0

    def load_reference(self) -> None:
        """The frozen KL reference from the post-warm-up snapshot, laid out as the policy is (model/parallelize.py:
        experts by EP rank, dense weights sharded with FSDP like the policy's, so it costs each rank its share),
        never recomputed (nothing of it is trained). Each rank reads only its own experts of the snapshot."""
        self.reference, _ = self._build_model(replace(self.plan, activation_checkpointing="off"), ep=self.ep,
                                              cp=self.model.cp)
        mine = local_experts(self.ep, self.run.model.num_experts)
        load_full_state(self.reference, load_hf(self.out / "eval" / "warmup", experts=mine)[1])
        self.reference.requires_grad_(False)

    def _save_eval_weights(self, name: str) -> None:
        """Keep the weights at a milestone (initial, after warm-up) for evaluation after the run."""
        state = gather_state(self.model)  # collective; the state on rank 0 only
        if self.rank == 0:
            save_hf(state, self.run.model, self.out / "eval" / name)
        if self.world > 1:
            dist.barrier()  # other ranks read the warm-up weights as their KL reference

    def _record(self, batch: Batch, metrics: dict, step_seconds: float) -> None:
        wall = time.monotonic() - self.started
        stats = batch.stats
        row = {"step": self.step, "version": self.step, "lineage": self.lineage, "time": time.time(),
               "wall_seconds": wall, "reward_mean": stats.reward_mean, "accuracy": stats.accuracy,
               "staleness_mean": stats.staleness_mean, "samples": len(batch.samples),
               "samples_per_second": self.samples_trained / wall, "step_seconds": step_seconds,
               "trainer_idle_fraction": self.wait_seconds / wall,
               "dropped_stale_groups": stats.dropped_stale_groups, "retries": stats.retries,
               "reward_failures": stats.rewards_failed, **metrics, **self.last_metrics}
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        with open(self.out / "trained.jsonl", "a") as f:
            # which samples trained, from which weights (each sample's spans: lineage, version, tokens): tests prove
            # from it that none trains twice or too stale
            f.write(json.dumps({"step": batch.step, "lineage": self.lineage, "ids": [s.id for s in batch.samples],
                                "versions": [[[v.lineage, v.version, v.tokens] for v in s.versions]
                                             for s in batch.samples]}) + "\n")
        for key, value in row.items():
            if isinstance(value, (int, float)) and key not in ("step", "time"):
                self.writer.add_scalar(key, value, self.step)
        for metric, value in ((M.TRAINER_STEP_SECONDS, step_seconds), (M.TRAINER_LAST_STEP_TIMESTAMP, row["time"]),
                              (M.TRAINER_TOKENS_PER_SECOND, metrics["tokens"] / max(step_seconds, 1e-9)),
                              (M.TRAINER_IDLE_FRACTION, row["trainer_idle_fraction"]),
                              (M.STRAGGLER_RATIO, metrics["straggler_ratio"]),
                              (M.EXPERT_LOAD_IMBALANCE, metrics["expert_load_imbalance"]),
                              (M.REWARD_MEAN, row["reward_mean"]), (M.SAMPLE_STALENESS, row["staleness_mean"]),
                              (M.LOGPROB_BITWISE_EQUAL, metrics["logprob_bitwise_equal"]),
                              (M.LOGPROB_ABS_DIFF_MAX, metrics["logprob_abs_diff_max"]),
                              (M.LOGPROB_ABS_DIFF_MEAN, metrics["logprob_abs_diff_mean"]),
                              (M.WEIGHT_PUBLISH_SECONDS, self.last_metrics.get(M.WEIGHT_PUBLISH_SECONDS.name, 0.0))):
            self.prometheus[metric].set(value)
        if "critic_explained_variance" in metrics:  # PPO only
            self.prometheus[M.CRITIC_EXPLAINED_VARIANCE].set(metrics["critic_explained_variance"])


def eval_snapshots(run: RunConfig, needs_reference: bool) -> tuple[str, ...]:
    """The milestone weights the trainer writes (float32, the whole model): where something reads them. A local
    run's evaluation reads both (initial and post-warm-up); elsewhere only the KL reference reads the post-warm-up
    weights."""
    if run.environment is None and run.resolved is None and run.rl.evaluation.snapshots:
        return ("initial", "warmup")
    return ("warmup",) if needs_reference else ()


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


def init_trainer_process_group() -> None:
    """This rank's default process group (torchrun's env:// variables), on its GPU: NCCL for CUDA tensors beside
    gloo for CPU ones, gloo alone without CUDA. DCP's async save refuses a group with no CPU backend ("A CPU
    backend must be enabled for async save"), and a one-rank trainer checkpoints over the default group."""
    if torch.cuda.is_available():
        torch.cuda.set_device(train_device())
    # Ranks other than 0 wait in a broadcast while rank 0 polls the orchestrator for a batch; the first batch on a
    # cluster (servers loading tens of GB, then generating) can take longer than the 10-minute default.
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                            timeout=datetime.timedelta(minutes=60))


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


def stop_on_sigterm(trainer: Trainer) -> None:
    """Kubernetes preemption: finish the step, checkpoint (all ranks together), exit 0."""
    def on_sigterm(signum, frame):
        trainer.stop_requested = True
    signal.signal(signal.SIGTERM, on_sigterm)


def main(argv: list[str]) -> int:
    parser = run_argparser("train", "train a run (start under torchrun)")
    parser.add_argument("--orchestrator", default=os.environ.get("MOERL_ORCHESTRATOR"),
                        help="orchestrator base URL (default: $MOERL_ORCHESTRATOR)")
    parser.add_argument("--metrics-port", type=int, default=TRAINER_METRICS_PORT,
                        help="Prometheus /metrics of each node's first rank; 0 = none")
    args = parser.parse_args(argv)
    if not args.orchestrator:
        parser.error("--orchestrator (or $MOERL_ORCHESTRATOR) is required: the trainer's batches come from it")
    run = load(args.run)
    torch.set_num_threads(1)
    cap_gpu_memory(run, "trainer")  # before this process allocates on its GPU
    init_trainer_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(run, HttpBatchSource(args.orchestrator), rank, world)
    trainer.out.mkdir(parents=True, exist_ok=True)
    if args.metrics_port and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        from prometheus_client import start_http_server
        start_http_server(args.metrics_port, registry=trainer.prometheus.registry)
    stop_on_sigterm(trainer)
    try:
        return trainer.run_loop()
    finally:
        dist.destroy_process_group()
