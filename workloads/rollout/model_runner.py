"""The model runner: a step's device tensors, the paged forward (prefill and decode), the CUDA graphs that replay
decode steps and their sampler, and sampling a step's rows; what it produced goes back as plain records.

The forward is model/paged_forward.py's over the KV cache: the model's own modules, so its numerics are the
trainer's, with attention over the paged KV cache and the norms, products and cache writes through the compute
backend's `ForwardKernels` (registry: model/backends.py): `triton` on a GPU, `torch` elsewhere, `exact` for the
exact numerics mode (the trainer's exact forward runs the same function over its packed sequences).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..model import MoETransformer
from ..model.backends import get_forward_kernels
from ..model.forward_kernels import ForwardKernels
from ..model.paged_forward import PackedAttention, paged_forward
from .kv_cache_manager import PagedCache
from .sampler import SamplerFlags, SamplingRows, sample
from .scheduler import PrefillPlan, Sequence

log = logging.getLogger(__name__)

# Decode steps of at most this many rows also replay the sampler from a CUDA graph (one per bucket and sampler
# flags, captured on first use): at a few rows its two dozen small kernels cost more host time than GPU time.
# Larger steps sample eagerly (their GPU step hides the host work, and the graphs' buffers would grow with the
# vocabulary times the rows).
SAMPLER_GRAPH_ROWS = 16


@dataclass
class SampledRows:
    """What the runner reports of a step's rows, in their order: the token each sampled, its logprob and, when
    some row asked for them, each row's alternatives the filters kept (None for a row that did not ask). Lists,
    not a record per row: every running row passes here every step."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]] | None] | None


@dataclass
class LaunchedDecode:
    """A decode step queued on the device: its rows, and its packed output (ModelRunner._sample_packed) being
    copied to the host, there once `ready` has passed (None: already there, as on a CPU)."""

    rows: list[Sequence]
    flags: SamplerFlags
    host: torch.Tensor
    ready: torch.cuda.Event | None


@dataclass
class PromptScores:
    """Logprobs of the prompt tokens a prefill chunk's positions predict (and their top alternatives)."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@dataclass
class SlotState:
    """Per-slot device state [slots + 1]: what a decode step reads (length, last sampled token) and each row's
    sampling parameters and seed words, written once when the row is admitted. Decode steps gather from it by
    slot, so a step sends the host nothing but the slot list."""

    length: torch.Tensor
    last_token: torch.Tensor
    step: torch.Tensor  # tokens sampled so far (the counter of the next draw)
    row: torch.Tensor
    key_lo: torch.Tensor
    key_hi: torch.Tensor
    top_k: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    raw: torch.Tensor

    @classmethod
    def allocate(cls, slots: int, device: torch.device) -> "SlotState":
        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(slots + 1, dtype=dtype, device=device)
        return cls(length=zeros(torch.long), last_token=zeros(torch.long), step=zeros(torch.long),
                   row=zeros(torch.long), key_lo=zeros(torch.long), key_hi=zeros(torch.long), top_k=zeros(torch.long),
                   temperature=zeros(torch.float32), top_p=zeros(torch.float32), min_p=zeros(torch.float32),
                   raw=zeros(torch.bool))

    def admit(self, seqs: list[Sequence]) -> None:
        idx = torch.tensor([s.slot for s in seqs], device=self.length.device)

        def put(target: torch.Tensor, values: list) -> None:
            target[idx] = torch.tensor(values, dtype=target.dtype).to(target.device, non_blocking=True)
        put(self.length, [0] * len(seqs))
        put(self.step, [len(s.tokens) for s in seqs])
        put(self.row, [s.request.row for s in seqs])
        put(self.key_lo, [s.seed & 0xFFFFFFFF for s in seqs])
        put(self.key_hi, [s.seed >> 32 for s in seqs])
        put(self.top_k, [s.params.top_k for s in seqs])
        put(self.temperature, [s.params.temperature for s in seqs])
        put(self.top_p, [s.params.top_p for s in seqs])
        put(self.min_p, [s.params.min_p for s in seqs])
        put(self.raw, [s.params.logprob_mode == "raw" for s in seqs])

    def sampling(self, slot: torch.Tensor, flags: SamplerFlags) -> SamplingRows:
        return SamplingRows(self.temperature[slot], self.top_p[slot], self.top_k[slot], self.min_p[slot],
                            self.raw[slot], self.key_lo[slot], self.key_hi[slot], self.row[slot], self.step[slot],
                            filtered=flags.filtered, any_raw=flags.any_raw, top_n=flags.top_n)


class DeviceClock:
    """The device's span of the runner's forwards and sampling, window by window (`start` before a window's first
    kernel is launched, `stop` after its last): on a GPU CUDA events, read once the GPU has passed them, so the
    clock adds no synchronisation; on a CPU, where the work runs as it is called, the windows' wall time. A step's
    wall time minus its windows is the host work the device waits for."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start: torch.cuda.Event | float | None = None
        self._windows: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # stopped, not yet read
        self._seconds = 0.0

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._windows.append((self._start, end))
        else:
            self._seconds += time.perf_counter() - self._start
        self._start = None

    def take(self) -> float:
        """Seconds of the windows finished since the last call (a window the GPU has not finished yet counts at a
        later call)."""
        done = 0
        while done < len(self._windows) and self._windows[done][1].query():
            begin, end = self._windows[done]
            self._seconds += begin.elapsed_time(end) / 1000
            done += 1
        del self._windows[:done]
        seconds, self._seconds = self._seconds, 0.0
        return seconds


def graph_buckets(slots: int) -> list[int]:
    """Batch sizes that decode steps are padded to (one CUDA graph each): 1, 2, 4, 8, then every 16 up to 256,
    every 64 up to 1,024, every 256 beyond; the last is `slots`."""
    sizes = [b for b in (1, 2, 4, 8) if b < slots]
    step = 16
    while not sizes or sizes[-1] < slots:
        nxt = (sizes[-1] // step + 1) * step if sizes else step
        sizes.append(min(nxt, slots))
        step = 16 if sizes[-1] < 256 else 64 if sizes[-1] < 1024 else 256
    return sizes


class ModelRunner:
    """Runs a model's forwards over a paged cache for one thread (the decoder's). On a GPU, decode steps replay
    CUDA graphs, one per batch bucket (`graph_buckets`): a step's rows are padded to the next bucket with the
    scratch slot, and the graph gathers their tokens and positions from the device state and reads the block
    tables (static device tensors), so the only host work of a step is the slot list in, any new table entries,
    and the sampled tokens out. `kernels`: the compute backend whose ForwardKernels it uses (default: triton on a
    GPU, torch elsewhere)."""

    def __init__(self, model: MoETransformer, cache: PagedCache, *, cuda_graphs: bool = True,
                 buckets: list[int] | None = None, kernels: str | None = None) -> None:
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.kernels: ForwardKernels = get_forward_kernels(kernels or ("triton" if self.device.type == "cuda"
                                                                       else "torch"))
        self.packed = PackedAttention(model)
        self.state = SlotState.allocate(self.slots, self.device)
        self.clock = DeviceClock(self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        # (bucket, filtered, any_raw) -> (graph, packed [bucket, 2] float64 (token, logprob) of every row)
        self.sampler_graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self.pool = None
        self.graph_slots: dict[int, tuple[int, ...]] = {}  # what each bucket's slot input holds
        if cuda_graphs and self.device.type == "cuda" and model.ep is None:
            self._capture(buckets or graph_buckets(self.slots))

    @property
    def slots(self) -> int:
        return self.cache.scratch

    def load_weights(self) -> None:
        """Refresh what the runner keeps of the model's weights (its packed buffers) after they were changed in
        place (weight_staging.install)."""
        self.packed.load(self.model)

    def admit(self, seqs: list[Sequence]) -> None:
        self.state.admit(seqs)

    # ---- the forward ---------------------------------------------------------------------------------------
    def forward(self, slot: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                key_len: int, tiles: torch.Tensor | None = None) -> torch.Tensor:
        """paged_forward over this runner's cache: a prefill chunk's prompts packed with their `tiles`, or a decode
        step's one token per row (tiles None); the logits [R, V] after tokens `last` [R]."""
        return paged_forward(self.model, self.packed, self.kernels, self.cache, slot, tokens, positions, last,
                             key_len, tiles)

    # ---- prefill -------------------------------------------------------------------------------------------
    def prefill(self, plan: PrefillPlan) -> tuple[torch.Tensor, list[PromptScores]]:
        """One prefill chunk: the plan's context tokens of each group at its leader's slot, packed into one forward
        with no padding. Returns the logits after each chunk's last token [chunks, V] and, for the chunks the plan
        scores, the logprobs of the prompt tokens their positions predict."""
        tokens, slots, positions, segments, last = [], [], [], [], []
        for group, take in plan.chunks:
            segments.append((len(tokens), take))
            tokens += group.context[group.prefilled:group.prefilled + take]
            slots += [group.rows[0].slot] * take
            positions += range(group.prefilled, group.prefilled + take)
            last.append(len(tokens) - 1)
        dev = self.device
        for i in plan.scored:  # every position of a scored chunk: its logits score the prompt token after it
            first, take = segments[i]
            last += range(first, first + take)
        packed = torch.tensor([tokens, slots, positions], dtype=torch.long)
        packed = (packed.pin_memory() if dev.type == "cuda" else packed).to(dev, non_blocking=True)
        tiles = self.kernels.prefill_tiles(segments, dev)
        self.cache.sync_tables()
        last = torch.tensor(last, device=dev)
        self.clock.start()
        logits = self.forward(packed[1], packed[0], packed[2], last, max(g.prefilled + take for g, take in plan.chunks),
                              tiles)
        self.clock.stop()
        scores = []
        if plan.scored:
            per_chunk = logits[len(plan.chunks):].split([segments[i][1] for i in plan.scored])
            scores = self._score_prompts([plan.chunks[i] for i in plan.scored], per_chunk)
            logits = logits[:len(plan.chunks)]
        return logits, scores

    @staticmethod
    def _score_prompts(chunks, logits) -> list[PromptScores]:
        """Logprobs of each group's prompt tokens that its chunk's positions predict (`logits` [take, V] per
        group, before `prefilled` moves): position p scores prompt token p + 1, under softmax(logits)."""
        top_n = max(r.params.top_logprobs for g, _ in chunks for r in g.rows if r.params.prompt_logprobs)
        scores = []
        for (group, take), chunk in zip(chunks, logits):
            targets = group.context[group.prefilled + 1:group.prefilled + take + 1]  # the last position: a new token
            score = PromptScores([], [])
            scores.append(score)
            if not targets:
                continue
            logp = torch.log_softmax(chunk[:len(targets)].float(), -1)
            chosen = logp.gather(-1, torch.tensor(targets, device=logp.device)[:, None])[:, 0]
            score.logprobs = chosen.tolist()
            if top_n:
                values, ids = logp.topk(top_n, -1)
                score.top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        return scores

    def sample_prefilled(self, rows: list[Sequence], lengths: list[int], logits: torch.Tensor) -> SampledRows:
        """Sample the first token of rows whose prefill ended (`logits` [rows, V], `lengths` their positions)."""
        slots = torch.tensor([r.slot for r in rows], device=self.device)
        lengths = torch.tensor(lengths, device=self.device)
        flags = SamplerFlags.of([r.params for r in rows])
        self.clock.start()
        self.state.length[slots] = lengths
        return self.sample(rows, slots, logits, flags)

    def scratch_forward(self) -> None:
        """One token of the scratch slot: an idle expert-parallel rank's part of a forward every rank joins."""
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        self.forward(zero + self.slots, zero, zero, zero, 1)

    # ---- decode --------------------------------------------------------------------------------------------
    def decode(self, rows: list[Sequence], key_len: int) -> SampledRows:
        """One decode step: each row's last sampled token fed at its length, then a token sampled per row.
        `key_len`: the longest row's length + 1 (bounds an eager step's attention)."""
        return self.collect(self.launch_decode(rows, key_len))

    def collect(self, launched: LaunchedDecode) -> SampledRows:
        """A launched step's tokens, once the device has produced them."""
        if launched.ready is not None:
            launched.ready.synchronize()
        return self._unpack(launched.rows, launched.flags, launched.host)

    def rewind(self, rows: list[Sequence], lengths: list[int]) -> None:
        """Undo a launched decode step of `rows` on the device (Scheduler.rewind on the host): each feeds its last
        sampled token again at `lengths`, drawing the same counter as before."""
        if not rows:
            return
        slot = torch.tensor([r.slot for r in rows], device=self.device)
        values = torch.tensor([[n, r.tokens[-1], len(r.tokens)] for r, n in zip(rows, lengths)], device=self.device)
        self.state.length[slot], self.state.last_token[slot], self.state.step[slot] = values.t()

    def launch_decode(self, rows: list[Sequence], key_len: int) -> LaunchedDecode:
        """Queue a decode step (decode) and the copy of its tokens to the host, without waiting for either."""
        self.cache.sync_tables()
        flags = SamplerFlags.of([r.params for r in rows])
        slots = [r.slot for r in rows]
        bucket = next((b for b in sorted(self.graphs) if b >= len(slots)), None)
        if bucket is not None:
            graph, slot_in, logits = self.graphs[bucket]
            padded = tuple(slots) + (self.slots,) * (bucket - len(slots))
            fresh = torch.tensor(padded).pin_memory() if self.graph_slots.get(bucket) != padded else None
            self.clock.start()
            if fresh is not None:  # steady decoding feeds the same slots: no copy
                slot_in.copy_(fresh, non_blocking=True)
                self.graph_slots[bucket] = padded
            graph.replay()
            slot, logits = slot_in[:len(slots)], logits[:len(slots)]
        else:
            slot = torch.tensor(slots, device=self.device)
            self.clock.start()
            logits = self._decode_forward(slot, key_len)
        packed = self._sampler_graph(bucket, flags)
        if packed is None:
            packed = self._sample_packed(slot, logits, flags)
        self.clock.stop()
        packed = packed[:len(rows)]
        if not packed.is_cuda:
            return LaunchedDecode(rows, flags, packed, None)
        # into pinned memory, so the copy is queued behind the step and the next step can be queued behind it (the
        # sampler's graph rewrites its output buffer)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedDecode(rows, flags, host, ready)

    def _decode_forward(self, slot: torch.Tensor, key_len: int) -> torch.Tensor:
        """Feed each slot's last sampled token at its length; what a CUDA graph captures (static shapes)."""
        start = self.state.length[slot]
        tokens = self.state.last_token[slot]
        rows = torch.arange(slot.shape[0], device=slot.device)
        logits = self.forward(slot, tokens, start, rows, key_len)
        self.state.length[slot] = start + 1
        self.state.length[self.slots:].zero_()  # padding rows fed the scratch slot (a kernel, no host copy)
        return logits

    # ---- sampling ------------------------------------------------------------------------------------------
    def sample(self, rows: list[Sequence], slot: torch.Tensor, logits: torch.Tensor, flags: SamplerFlags
               ) -> SampledRows:
        """Sample `rows` (at `slot`) from `logits`; ends the device clock's window."""
        packed = self._sample_packed(slot, logits, flags)
        self.clock.stop()  # before the copy that waits for the device: the host's part of the step follows
        return self._unpack(rows, flags, packed.cpu())

    @staticmethod
    def _unpack(rows: list[Sequence], flags: SamplerFlags, host: torch.Tensor) -> SampledRows:
        """The packed output of `rows` ([rows, 2 + 2 top_n] on the host) as lists."""
        tokens, logprobs = host[:, 0].long().tolist(), host[:, 1].tolist()  # (a token id is exact in float64)
        top_n = flags.top_n
        if not top_n:
            return SampledRows(tokens, logprobs, None)
        tops = []
        for r, values in zip(rows, host.tolist()):
            top = None
            if r.params.top_logprobs:
                n = r.params.top_logprobs
                # alternatives the filters cut (logprob -inf under the processed distribution) are left out
                top = [(int(t), lp) for t, lp in zip(values[2:2 + n], values[2 + top_n:2 + top_n + n])
                       if lp != float("-inf")]
            tops.append(top)
        return SampledRows(tokens, logprobs, tops)

    def _sample_packed(self, slot: torch.Tensor, logits: torch.Tensor, flags: SamplerFlags) -> torch.Tensor:
        """Sample a token for each slot of `slot`, advance their state, and return [B, 2 + 2 top_n] float64:
        token (exact in float64), logprob, then the top alternatives' ids and logprobs (one copy to the host)."""
        out = sample(logits, self.state.sampling(slot, flags))
        self.state.last_token[slot] = out.tokens
        self.state.step[slot] += 1
        packed = [out.tokens.double()[:, None], out.logprobs.double()[:, None]]
        if flags.top_n:
            packed += [out.top_ids.double(), out.top_logprobs.double()]
        return torch.cat(packed, 1)

    def _sampler_graph(self, bucket: int | None, flags: SamplerFlags) -> torch.Tensor | None:
        """Replay the sampler of decode bucket `bucket` (capturing it on first use); its packed output, or None
        where the sampler runs eagerly."""
        if bucket is None or bucket > SAMPLER_GRAPH_ROWS or flags.top_n:
            return None
        key = (bucket, flags.filtered, flags.any_raw)
        if key not in self.sampler_graphs:
            try:
                self._capture_sampler(bucket, flags)
            except RuntimeError as exc:  # sample eagerly from now on for these flags: slower but right
                log.warning("the sampler runs without a CUDA graph: capturing it failed: %s", str(exc).splitlines()[0])
                self.sampler_graphs[key] = None
        if self.sampler_graphs[key] is None:
            return None
        graph, packed = self.sampler_graphs[key]
        graph.replay()
        return packed

    # ---- CUDA graphs ---------------------------------------------------------------------------------------
    def _capture(self, buckets: list[int]) -> None:
        """One CUDA graph per bucket, largest first so the smaller ones reuse its memory pool. Each bucket runs
        eagerly first (kernel autotuning and compilation happen outside the capture)."""
        try:
            self._capture_buckets(buckets)
        except RuntimeError as exc:  # an op that cannot be captured: decode eagerly, slower but right (e.g. the
            # torch backend's float32 experts loop over a host copy of the expert counts; bf16 uses a grouped GEMM)
            log.warning("decode steps run without CUDA graphs: capturing them failed: %s", str(exc).splitlines()[0])
            self.graphs, self.sampler_graphs = {}, {}

    def _capture_buckets(self, buckets: list[int]) -> None:
        pool = self.pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            for size in sorted(set(buckets), reverse=True):
                slot = torch.full((size,), self.slots, dtype=torch.long, device=self.device)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._decode_forward(slot, self.cache.max_len)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._decode_forward(slot, self.cache.max_len)
                self.graphs[size] = (graph, slot, logits)
                if size <= SAMPLER_GRAPH_ROWS:  # plain sampling (RL's temperature-only rows) ready from the start
                    self._capture_sampler(size, SamplerFlags(filtered=False, any_raw=False, top_n=0))
        torch.cuda.synchronize(self.device)

    def _capture_sampler(self, bucket: int, flags: SamplerFlags) -> None:
        _, slot_in, logits = self.graphs[bucket]
        scratch = torch.full_like(slot_in, self.slots)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up (kernel compilation) on the scratch slot only
            self._sample_packed(scratch, logits, flags)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            packed = self._sample_packed(slot_in, logits, flags)
        self.sampler_graphs[(bucket, flags.filtered, flags.any_raw)] = (graph, packed)
