"""Continuous-batching decoding over a paged KV cache: the scheduler, the KV-cache manager and the model runner
of one replica (or one expert-parallel rank), stepped together.

A `Decoder` runs up to `slots` rows at once, each up to `max_len` positions. Their keys, values and routed expert
ids live in one pool of fixed-size blocks (kv_cache_manager); a row finds its positions through its block table.
Rows join at any step: a row waits until a slot and its prompt's blocks are free, its prompt is prefilled (packed
with the other prompts being prefilled, no padding, in chunks of at most `prefill_tokens` tokens interleaved with
the running rows' decode steps), and it then decodes one token per step, taking a new block as it crosses a block
boundary, until it samples a stop token or reaches its max_tokens; finished and cancelled rows return their slot
and blocks at once. When the decoding rows need more blocks than are free, the newest are preempted and
recomputed later (scheduler). A group's rows (GRPO's n samples of one prompt, admitted together) share one prefill
and the prompt's full blocks; only its partial last block is copied.

Every row computes only on its own positions, and its randomness is a counter-based function of (seed, row, step)
computed on the device (sampler), so a row's tokens, logprobs and routing do not depend on which rows shared its
steps (up to floating-point reduction order).

With `look_ahead` (rollout.async_scheduling, as vLLM's asynchronous scheduling) the device stays busy between
steps: the next decode step is queued on the device before the host books the current one's tokens (a step reads
each row's last token from the device, and a row that continues by length needs nothing else from the host), so
the host's bookkeeping runs while the device computes. A row whose booked token turns out to be a stop token has
its already queued next token dropped; rows that finished their prefill join the step after; new weights
installed under a queued step undo it (`load_weights`), so every token after a swap is the new weights'.
Expert-parallel decoders (every rank agrees on each forward) step one at a time.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from ..model import MoETransformer
from ..moe.parallel import decode_phase
from .engine_api import RowOutput, RowRequest
from .kv_cache_manager import BLOCK_SIZE, PagedCache, fitting_blocks
from .model_runner import LaunchedDecode, ModelRunner
from .scheduler import DecodePlan, Scheduler, Sequence, StepEvents

log = logging.getLogger(__name__)


class Decoder:
    """A scheduler and a model runner over one paged cache. Not thread-safe: one thread (the engine's loop) calls
    it. `blocks` blocks of `block_size` positions (default: enough for every row at `max_len`) are granted as a row
    grows and returned when it finishes or is cancelled, so memory follows the tokens present."""

    def __init__(self, model: MoETransformer, *, slots: int, max_len: int, eos_ids: Iterable[int],
                 prefill_tokens: int = 4096, cuda_graphs: bool = True, buckets: list[int] | None = None,
                 blocks: int | None = None, block_size: int = BLOCK_SIZE, kernels: str | None = None,
                 look_ahead: bool = False) -> None:
        self.model = model
        param = next(model.parameters())
        blocks = slots * -(-max_len // block_size) if blocks is None else blocks
        cache = PagedCache.allocate(model.config, slots, max_len, blocks, block_size, param.device, param.dtype)
        self.scheduler = Scheduler(cache, eos_ids=eos_ids, vocab_size=model.config.vocab_size,
                                   prefill_tokens=prefill_tokens)
        self.runner = ModelRunner(model, cache, cuda_graphs=cuda_graphs, buckets=buckets, kernels=kernels)
        self._preemptions_taken = 0  # the part of the scheduler's preemptions take_preemptions() has handed out
        self.look_ahead = look_ahead
        self._launched: LaunchedDecode | None = None  # a decode step queued on the device, not yet booked

    @classmethod
    def in_free_memory(cls, model: MoETransformer, *, slots: int, max_len: int, eos_ids: Iterable[int],
                       kernels: str | None = None, look_ahead: bool = False) -> "Decoder":
        """A decoder whose block pool holds every row at `max_len`, or on a GPU as many blocks as fit its free
        memory (then rows wait for blocks, and decoding rows may be preempted)."""
        wanted = slots * -(-max_len // BLOCK_SIZE)
        param = next(model.parameters())
        blocks = fitting_blocks(model.config, param.dtype, param.device, wanted)
        if blocks < wanted:
            log.warning("KV cache: %d blocks of %d positions fit in this GPU's free memory, %d rows of %d positions "
                        "would need %d; rows wait for free blocks", blocks, BLOCK_SIZE, slots, max_len, wanted)
        return cls(model, slots=slots, max_len=max_len, eos_ids=eos_ids, blocks=blocks, kernels=kernels,
                   look_ahead=look_ahead)

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> dict[str, int]:
        """KV-cache blocks (total, used, free, positions per block) and preemptions so far."""
        return {**self.scheduler.cache.stats(), "preemptions": self.scheduler.preemptions}

    def take_device_seconds(self) -> float:
        """Seconds the device spent on this decoder's forwards and sampling since the last call (ModelRunner's
        DeviceClock)."""
        return self.runner.clock.take()

    def take_preemptions(self) -> int:
        """Preemptions since the last call (a counter metric adds them: a decoder built anew starts from zero
        without the caller keeping a baseline)."""
        total = self.scheduler.preemptions
        new, self._preemptions_taken = total - self._preemptions_taken, total
        return new

    def add(self, request: RowRequest) -> Sequence:
        """Queue a row (Scheduler.add): ValueError if it can never fit."""
        return self.scheduler.add(request)

    def cancel(self, seq: Sequence) -> bool:
        return self.scheduler.cancel(seq)

    def load_weights(self) -> None:
        """The model's weights changed in place (a version installed): refresh what the runner derives from them,
        and undo a decode step queued under the old ones (its rows decode it again with the new)."""
        if self._launched is not None:
            self.runner.collect(self._launched)  # (the install waited for it; its tokens are dropped)
            self._launched = None
            rows = self.scheduler.rewind()
            self.runner.rewind(rows, [self.scheduler.length[r.slot] for r in rows])
        self.runner.load_weights()

    @torch.no_grad()
    def step(self, *, agree: Callable[[bool], bool] | None = None) -> StepEvents:
        """One step: admit waiting rows into free slots and blocks, run one prefill chunk if any prompt is being
        prefilled, then one decode forward for every row with a token to feed. On an expert-parallel server every
        rank must join every forward (the MoE layers exchange tokens): `agree(this rank has work)` says whether any
        rank has, and a rank without work then feeds one token of its scratch slot."""
        scheduler, runner = self.scheduler, self.runner
        events = StepEvents([], [])
        admitted = scheduler.admit()
        if admitted:
            runner.admit(admitted)
        if agree(bool(scheduler.prefilling)) if agree is not None else scheduler.prefilling:
            self._prefill(events)
        if agree(bool(scheduler.decoding)) if agree is not None else scheduler.decoding or self._launched:
            with decode_phase(self.model.ep):  # an expert-parallel server's decode dispatcher (DeepEP low-latency)
                self._decode(events, ahead=self.look_ahead and agree is None)
        return events

    def _prefill(self, events: StepEvents) -> None:
        scheduler = self.scheduler
        if not scheduler.prefilling:  # an idle expert-parallel rank: one scratch token keeps it in step
            self.runner.scratch_forward()
            return
        plan = scheduler.plan_prefill()
        logits, scores = self.runner.prefill(plan)
        rows, which = scheduler.prefilled(plan, scores)
        if rows:
            sampled = self.runner.sample_prefilled(rows, [scheduler.length[r.slot] for r in rows],
                                                   logits[torch.tensor(which, device=logits.device)])
            scheduler.sampled(rows, sampled, events)

    def _decode(self, events: StepEvents, ahead: bool) -> None:
        """Book one decode step: the one queued at the last step, or one planned and launched now; with `ahead`,
        the next is launched before this one's tokens are booked."""
        scheduler, launched = self.scheduler, self._launched
        if launched is None:
            plan = scheduler.plan_decode()
            if not plan.rows:  # an idle expert-parallel rank, or every row preempted (blocks held by prefilling rows)
                self.runner.scratch_forward()
                return
            launched = self._launch(plan)
        nxt = scheduler.plan_ahead(launched.rows) if ahead else None
        self._launched = self._launch(nxt) if nxt is not None else None
        scheduler.sampled(launched.rows, self.runner.collect(launched), events)

    def _launch(self, plan: DecodePlan) -> LaunchedDecode:
        launched = self.runner.launch_decode(plan.rows, plan.key_len)
        self.scheduler.decoded(plan)
        return launched


@torch.no_grad()
def decode_all(model: MoETransformer, requests: list[RowRequest], eos_ids: Iterable[int]) -> list[RowOutput]:
    """Decode `requests` to the end in one decoder sized for them, in this process (local evaluation, benchmarks,
    tests); the engine's records in and out."""
    decoder = Decoder(model, slots=len(requests),
                      max_len=max(len(r.prompt_ids) + r.params.max_tokens for r in requests), eos_ids=eos_ids,
                      prefill_tokens=sum(len(r.prompt_ids) for r in requests))
    seqs = [decoder.add(r) for r in requests]
    while decoder.busy:
        decoder.step()
    return [s.output(None, None) for s in seqs]
