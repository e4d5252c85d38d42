"""One rollout server's model replica: in this process, or expert-parallel over the server's GPUs.

A server with `rollout.gpus_per_server` > 1 runs one torchrun rank per GPU (`core.launch`). The experts are
split over the ranks in contiguous slices, as the trainer splits them, and the rest of the model is replicated.
Each rank decodes its own rows with its own continuous-batching decoder (data-parallel attention: a rank's KV
cache holds only its rows) and the MoE layers exchange tokens at every forward (prefill by all-to-all, decode by
DeepEP's low-latency kernels where they apply: `ExpertParallel.for_serving`), so every rank runs every forward (one
without work feeds a scratch token). A replica in one process is the same with one rank: its decoder, its steps. Rank 0 serves HTTP and runs the engine; every operation
it runs on the replica (start reading a weight version, swap it in, one decoding step with the rows each rank
takes on or cancels) it first broadcasts to the other ranks (`follow`), which then do their part in the same
order.
"""
from __future__ import annotations

import datetime
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl_eks.core.run import RunConfig

from ..model import MoETransformer
from ..model.checkpoint import empty_model
from ..moe.parallel import ExpertParallel, local_experts
from .engine_api import RowOutput, RowRequest
from .decoder import Decoder
from .scheduler import Sequence
from ..rl.device_weights import DeviceImporter
from ..rl.protocol import VersionRef
from .weight_sources import DeviceSource, StoreSource, VersionSource
from .weight_staging import HostStaging, install

log = logging.getLogger(__name__)
# The other ranks wait on the control group for rank 0's next operation, and a server may sit idle for days.
IDLE_TIMEOUT = datetime.timedelta(days=30)


@dataclass(frozen=True)
class StepPlan:
    """What rank 0 tells every rank for one step of an expert-parallel server: per rank, the rows it takes on and
    the (request_id, row) it cancels; and how its decoder is sized."""

    admit: list[list[RowRequest]]
    cancel: list[list[tuple[str, int]]]
    slots: int  # rows a rank decodes at once (its KV-cache blocks: as many as fit its GPU)
    max_len: int
    eos_ids: tuple[int, ...]


@dataclass
class RankReport:
    """What one rank did in a step: the tokens its rows sampled (request_id, row, token, logprob, top), the rows
    that finished, and its decoder's state after the step (rows running and waiting, KV-cache blocks, preemptions
    in this step, the device's seconds on its forwards and sampling: Decoder.take_device_seconds)."""

    sampled: list[tuple[str, int, int, float, list[tuple[int, float]] | None]]
    finished: list[RowOutput]
    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    preemptions: int = 0
    device_seconds: float = 0.0


class SwapRefused(RuntimeError):
    """A weight version every rank refused together (some rank could not read or fit it)."""


class Replica:
    """The model a rollout server samples from. Its methods are called by one thread (rank 0's batcher); on a
    sharded server each call also runs on every other rank, through `follow`."""

    def __init__(self, run: RunConfig, *, ep: ExpertParallel | None = None, control=None,
                 device: torch.device | None = None, importer: DeviceImporter | None = None) -> None:
        """`importer`: take versions from the trainer's GPU memory when it shares this GPU (else the store)."""
        self.run, self.ep, self.control = run, ep, control
        self.rank, self.size = (ep.rank, ep.size) if ep is not None else (0, 1)
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model: MoETransformer | None = None
        self.version: int | None = None
        self.lineage: int | None = None  # with version: the published VersionRef served
        self.decoder: Decoder | None = None  # this rank's rows (rank 0's engine drives it), built at the first step
        self._rows: dict[tuple[str, int], Sequence] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="weights-reader")
        self._reading: tuple[int, Future] | None = None
        self.staging = HostStaging(pin=self.device.type == "cuda")
        store = StoreSource(self.staging)
        self.source: VersionSource = store if importer is None else DeviceSource(importer, store)

    @classmethod
    def sharded(cls, run: RunConfig) -> "Replica":
        """This rank's part of a server started by torchrun with one rank per GPU."""
        # torchrun sets LOCAL_WORLD_SIZE; a server's ranks are one node's, so WORLD_SIZE is the same where it is not
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        transport, device, why = rank_placement(int(os.environ["LOCAL_RANK"]), local_ranks, torch.cuda.device_count())
        log.info("sharded server rank on %s over %s: %s", device, transport, why)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(transport)
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        # Prefill over the all-to-all; decode over DeepEP's low-latency kernels where the topology allows them
        # (the all-to-all too in the exact numerics mode).
        ep = ExpertParallel.for_serving(dist.group.WORLD, run.model, device=str(device),
                                        rows_per_rank=rows_per_rank(run, dist.get_world_size()),
                                        exact=run.numerics == "exact")
        return cls(run, ep=ep, control=control, device=device)

    # ---- operations, run on every rank in the same order -------------------------------------------------
    def begin_read(self, version: int, path: str, lineage: int = 0) -> Future:
        """Start reading `version` (this rank's experts only) in the background: serving goes on meanwhile."""
        self._tell("begin_read", version, path, lineage)
        # From the store into the host staging (pinned, verified as read; weight_staging says why not onto the
        # GPU), or taken from the trainer's export on this GPU (weight_sources); the swap copies it into the
        # served tensors in place. One reader thread: a read never overwrites the staging while another read's
        # tensors are in use.
        read = self._reader.submit(self.source.read, VersionRef(lineage, version), path,
                                   local_experts(self.ep, self.run.model.num_experts))
        self._reading = ((lineage, version), read)
        return read

    def swap(self, version: int, lineage: int = 0) -> None:
        """Install the weights `begin_read` read, on every rank or (if any rank failed to read them) on none.
        Between steps, with or without rows running: they keep their slots and KV cache and decode their next
        token with the new weights (their spans say from which token on)."""
        self._tell("swap", version, lineage)
        error = model = staged = None
        try:
            if self._reading is None or self._reading[0] != (lineage, version):
                raise RuntimeError(f"version {version} of lineage {lineage} was not read first")
            staged = self._reading[1].result()
            model = self.model or empty_model(staged.config, self.ep, self.run.serving_compute, self.device)
            check_fits(staged.state, model.state_dict())
        except Exception as exc:  # noqa: BLE001 -- agreed on below, then raised on every rank
            error = f"rank {self.rank}: {exc}"
        self._reading = None
        try:
            errors = [e for e in self._all(error) if e]
            if errors:
                raise SwapRefused("; ".join(errors))
            install(model, staged.state)  # copies into the served tensors: the decoder's CUDA graphs stay valid
            log.info("weight version %d (lineage %d) installed from the %s", version, lineage, staged.via)
        finally:
            if staged is not None:
                staged.release()  # the source may reuse its buffers (the trainer its export)
        if self.decoder is not None and self.decoder.model is model:
            self.decoder.load_weights()  # and what its runner derives from them (packed q/k/v), in place too
        self.model = model.eval()
        self.version, self.lineage = version, lineage

    def step(self, plan: StepPlan) -> list[RankReport] | None:
        """One continuous-batching step on every rank: each takes its new rows and cancels, then all run the same
        forwards (a rank without work feeds a scratch token), each decoding its own rows. Rank 0 gets every rank's
        report; the other ranks None. A step without rows builds each rank's decoder (KV cache, CUDA graphs)."""
        self._tell("step", plan)
        if self.size == 1:  # a failed step fails its rows (the engine's to report), not the server
            return self._step(plan)
        try:
            return self._step(plan)
        except Exception:
            # The other ranks are inside a collective this rank will never join: end the whole server (torchrun
            # stops every rank, Kubernetes restarts the pod) rather than leave it hung.
            log.exception("rank %d failed in a sharded step; stopping the server", self.rank)
            os._exit(1)

    def _step(self, plan: StepPlan) -> list[RankReport] | None:
        if self.decoder is None or self.decoder.model is not self.model:
            self.decoder = Decoder.in_free_memory(self.model, slots=plan.slots, max_len=plan.max_len,
                                                  eos_ids=plan.eos_ids, kernels=engine_kernels(self.run),
                                                  look_ahead=self.run.rollout.look_ahead)
            self._rows = {}
        report = RankReport([], [])
        for request in plan.admit[self.rank]:
            try:
                self._rows[(request.request_id, request.row)] = self.decoder.add(request)
            except ValueError as exc:
                report.finished.append(RowOutput(request.request_id, request.row, [], [], None, "error", str(exc),
                                                 None, self.version, self.lineage or 0))
        for key in plan.cancel[self.rank]:
            seq = self._rows.pop(key, None)
            if seq is not None and self.decoder.cancel(seq):
                report.finished.append(seq.output(self.version, self.lineage))
        events = self.decoder.step(agree=self._any if self.size > 1 else None)
        lineage, version, sampled = self.lineage or 0, self.version, report.sampled
        for seq, token, logprob, top in events.sampled:
            seq.weights_of(lineage, version)  # the weights of this step sampled it (a swap comes between steps)
            sampled.append((seq.request.request_id, seq.request.row, token, logprob, top))
        for seq in events.finished:
            self._rows.pop((seq.request.request_id, seq.request.row), None)
            report.finished.append(seq.output(self.version, self.lineage))  # routing comes to the host here
        stats = self.decoder.stats()
        report.running, report.waiting = self.decoder.running, self.decoder.waiting
        report.blocks_used, report.blocks_total = stats["blocks_used"], stats["blocks_total"]
        report.preemptions = self.decoder.take_preemptions()
        report.device_seconds = self.decoder.take_device_seconds()
        if self.size == 1:
            return [report]
        parts = [None] * self.size if self.rank == 0 else None
        dist.gather_object(report, parts, dst=0, group=self.control)
        return parts

    def finish_all(self, reason: str, error: str | None = None) -> list[RowOutput]:
        """Finish every row this rank holds with `reason` (and `error`) and drop its decoder (its cache may hold
        half a step; the next step builds a fresh one): the engine's way out of a failed step, or a stop. This
        rank only, not a step of the replica."""
        outputs = []
        for seq in self._rows.values():
            seq.finish_reason, seq.error = reason, error
            outputs.append(seq.output(self.version, self.lineage))
        self._rows, self.decoder = {}, None
        return outputs

    def stop(self) -> None:
        self._tell("stop")
        self._reader.shutdown(wait=True, cancel_futures=True)  # a read in progress ends before its buffers go
        self.source.close()

    # ---- the control channel ---------------------------------------------------------------------------
    def _tell(self, op: str, *args) -> None:
        if self.size > 1 and self.rank == 0:
            dist.broadcast_object_list([(op, args)], src=0, group=self.control)

    def _all(self, value):
        if self.size == 1:
            return [value]
        values = [None] * self.size
        dist.all_gather_object(values, value, group=self.control)
        return values

    def _any(self, local: bool) -> bool:
        flag = torch.tensor([int(local)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return bool(flag)


def engine_kernels(run: RunConfig) -> str | None:
    """The paged forward's kernels (model/backends.py) for `run`: the exact backend's in the exact numerics mode,
    else the runner's default (triton on a GPU, torch elsewhere)."""
    return "exact" if run.numerics == "exact" else None


def rows_per_rank(run: RunConfig, ranks: int) -> int:
    """Decode rows per rank of a sharded server: rollout.max_batch_size split over its ranks."""
    return max(1, run.rollout.max_batch_size // ranks)


def rank_placement(local_rank: int, local_ranks: int, cuda_devices: int) -> tuple[str, torch.device, str]:
    """(process-group backend, device, why) of one rank of a sharded server: a GPU per rank over NCCL; with fewer
    GPUs than ranks (a test on one GPU) every rank on cuda:0 over gloo, since NCCL cannot put two ranks on one
    GPU; gloo on CPUs."""
    if cuda_devices == 0:
        return "gloo", torch.device("cpu"), "no GPU"
    if cuda_devices < local_ranks:
        return "gloo", torch.device("cuda", 0), (f"{local_ranks} ranks share {cuda_devices} GPU(s): all on cuda:0 "
                                                 f"(NCCL cannot put two ranks on one GPU; gloo moves through the host)")
    return "nccl", torch.device("cuda", local_rank), "one GPU per rank"


def check_fits(state: dict[str, torch.Tensor], served: dict[str, torch.Tensor]) -> None:
    """A new version must have exactly the served model's tensors and shapes (checked before the ranks agree to
    swap, so no rank can fail after the others have swapped)."""
    for name in sorted(set(state) | set(served)):
        if name not in state or name not in served or state[name].shape != served[name].shape:
            have = tuple(state[name].shape) if name in state else "nothing"
            want = tuple(served[name].shape) if name in served else "nothing"
            raise RuntimeError(f"{name}: the version has {have}, the served model {want}")


def follow(replica: Replica) -> None:
    """Ranks other than 0: do rank 0's operations, in its order, until it stops."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=replica.control)
        op, args = message[0]
        if op == "stop":
            replica.stop()
            return
        try:
            getattr(replica, op)(*args)
        except SwapRefused as exc:  # refused on every rank alike; rank 0 reports it to the loader
            log.warning("rank %d: %s failed: %s", replica.rank, op, exc)
