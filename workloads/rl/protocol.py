"""What crosses a process boundary between the RL roles, as typed records: weight versions, routing references,
request seeds, completion results, training samples and batches, and the orchestrator's checkpointed state.

Torch-free and dependency-free, so the orchestrator image, the trainer on a GPU machine without pydantic, and checkpoints all read the same records. Every record
converts with `to_json()` (plain JSON types) and `Record.from_json(data)`, which rejects malformed input with a
`ProtocolError` naming the field path (`batch.samples[3].advantage`), the value and what was expected.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin, get_type_hints


R = TypeVar("R", bound="Record")
FinishReason = Literal["stop", "length", "abort"]


class ProtocolError(ValueError):
    """A wire record is malformed; the message names the field path, the value and what is allowed."""

    def __init__(self, path: str, value: Any, expected: str) -> None:
        self.path, self.value, self.expected = path, value, expected
        shown = repr(value)
        super().__init__(f"{path}: {shown if len(shown) <= 80 else shown[:77] + '...'} is not allowed; {expected}")


# Layout versions: the records between the roles (WIRE_FORMAT), the orchestrator's persisted state
# (STATE_FORMAT) and the trainer's checkpoints (CHECKPOINT_FORMAT: trainer.json and the DCP keys beside it). Writers
# set them explicitly; a record without one is from before formats were recorded, which is format 1's layout. Bump
# one when its layout changes, and read the older one (migrate) or refuse it (check_format).
# Format 2 (wire and state): every sample carries the weight versions of its tokens (VersionSpan), which a format-1
# record lacks and cannot be given after the fact (its server may have swapped weights under it), so it is refused.
# Format 3 (wire and state): a sample refers to its routed experts in the routing store (RoutingRef) instead of
# carrying them inline as base64. A format-2 record without routing has format 3's layout and is read as format 3
# (migrated); one with inline routing arrays is refused (MIGRATIONS).
# State format 4: the state lists the prompts a trainer trained in steps it never recorded (`trained_ahead`, after
# a catch-up: GroupBuffer.catch_up); a format-3 state has none, and is read as format 4 with an empty list.
# State format 5: the orchestrator's own state file also holds the state from before a catch-up (`held`, until a
# checkpoint retires it), so a restart does not forget it; a format-4 state held none, and is read as format 5.
# Checkpoint format 2: PPO's critic is an MLP under `critic.*` (trainer/critic.py) where format 1 held a linear
# `value_head`; the policy's keys are unchanged, so a format-1 checkpoint of a run without a critic is read as it is
# and one with a value head is refused (trainer/checkpoint.py, read_meta).
WIRE_FORMAT = 3
STATE_FORMAT = 5
CHECKPOINT_FORMAT = 2
_SPANS = "format 2 records each sample's per-token weight versions"
_ROUTING = "format 3 refers to each sample's routed experts in the routing store instead of carrying them inline"
# what each format changed, by the kind of record it numbers (the text a refusal of an older one shows)
FORMAT_CHANGES = {"wire": {2: _SPANS, 3: _ROUTING},
                  "state": {2: _SPANS, 3: _ROUTING,
                            4: "format 4 lists the prompts a trainer trained in steps the state never recorded",
                            5: "format 5 keeps the state from before a catch-up until a checkpoint retires it"},
                  "checkpoint": {2: "format 2 holds PPO's critic as an MLP under critic.*"}}


def check_format(found: int, current: int, what: str, kind: str) -> str | None:
    """What is wrong with a `kind` record ("wire", "state", "checkpoint") of format `found` (checked before its
    fields, so an older layout is refused as such, not as a field missing), None when this code reads it (a
    migratable older format included)."""
    if found > current:
        return (f"this {what} was written in format {found} by a newer moe-rl-eks; this one reads formats up to "
                f"{current}: upgrade every role, or resume from a checkpoint of this version")
    if found < 1:
        return f"a format >= 1 (this code writes {current})"
    if found < current and found not in MIGRATIONS.get(kind, ()):
        changes = "; ".join(FORMAT_CHANGES[kind][f] for f in range(found + 1, current + 1))
        return (f"this {what} was written in format {found} by an older moe-rl-eks; this one reads format {current} "
                f"({changes}): run every role at one moe-rl-eks version, and resume only from a checkpoint this "
                f"version wrote")
    return None


def _inline_routing(data: Any) -> bool:
    """Whether a format-2 record carries a routing array inline (a string `routing` in any of its samples)."""
    if isinstance(data, dict):
        return isinstance(data.get("routing"), str) or any(_inline_routing(v) for v in data.values())
    return isinstance(data, list) and any(_inline_routing(v) for v in data)


def _format_2(data: Any) -> str | None:
    return ("this record of format 2 carries routing arrays inline, which format 3 keeps in the routing store "
            "(rl.routing) and the orchestrator never holds: finish the run at the older moe-rl-eks, or restart it (a "
            "format-2 state or batch without routing replay is read as is)") if _inline_routing(data) else None


# kind of record -> the older formats read as its current one, each with the check that refuses what cannot be
# migrated ((record JSON) -> why not, or None)
MIGRATIONS: dict[str, dict[int, Any]] = {"wire": {2: _format_2},
                                         "state": {2: _format_2, 3: lambda data: None, 4: lambda data: None}}


# ---- decoding -------------------------------------------------------------------------------------------------
def _decode(tp: Any, value: Any, path: str) -> Any:
    """`value` (parsed JSON) as type `tp`, or ProtocolError at `path`."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = [o for o in get_args(tp) if o is not type(None)]
        if value is None:
            if len(options) < len(get_args(tp)):
                return None
            raise ProtocolError(path, value, "required (null is not allowed)")
        return _decode(options[0], value, path)  # our records use X | None only
    if origin is Literal:
        if value not in get_args(tp):
            raise ProtocolError(path, value, "allowed: " + ", ".join(repr(a) for a in get_args(tp)))
        return value
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp._from_json(value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(path, value, "expected a list")
        item = get_args(tp)[0]
        fast = _FAST_ITEMS.get(item)
        if fast is not None and all(map(fast, value)):  # token ids, logprobs: no per-item path unless one is bad
            items = [float(v) for v in value] if item is float else list(value)
        else:
            items = [_decode(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(path, value, "expected an object")
        key_tp, val_tp = get_args(tp)
        out = {}
        for k, v in value.items():
            key = k
            if key_tp is int:  # JSON object keys are strings
                try:
                    key = int(k)
                except (TypeError, ValueError):
                    raise ProtocolError(f"{path}.{k}", k, "expected an integer key") from None
            out[key] = _decode(val_tp, v, f"{path}.{k}")
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(path, value, "expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(path, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProtocolError(path, value, "expected a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(path, value, "expected a string")
        return value
    if tp is Any:  # JSON carried through as is (a prompt's ground truth, a prompt source's state)
        return value
    raise TypeError(f"protocol: unsupported field type {tp!r} at {path}")


# Item checks for the long lists (token ids, logprobs): exactly what _decode accepts for int and float.
_FAST_ITEMS = {int: lambda v: type(v) is int,
               float: lambda v: (type(v) is float and math.isfinite(v)) or type(v) is int}


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A record class's resolved field types and its fields (resolving the annotations per record costs more
    than decoding a batch's numbers)."""
    return get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


def _encode(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        if all(type(v) in (int, float) for v in value):  # token ids, logprobs: nothing to convert
            return list(value)
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


class Record:
    """Base of the wire records (dataclasses): JSON out, checked JSON in, then the record's own `check()`. A
    record with a `format` field names (its current format, what it is, its kind: check_format) in FORMAT."""

    FORMAT: ClassVar[tuple[int, str, str] | None] = None

    def to_json(self) -> dict:
        """Plain JSON types; an optional field that is None (its default) is left out."""
        return {f.name: _encode(getattr(self, f.name)) for f in _schema(type(self))[1].values()
                if not (f.default is None and getattr(self, f.name) is None)}

    @classmethod
    def from_json(cls: type[R], data: Any, path: str | None = None) -> R:
        return cls._from_json(data, path or _snake(cls.__name__))

    @classmethod
    def _from_json(cls: type[R], data: Any, path: str) -> R:
        if not isinstance(data, dict):
            raise ProtocolError(path, data, f"expected an object ({cls.__name__})")
        hints, fields = _schema(cls)
        if cls.FORMAT is not None:
            found = _decode(int, data.get("format", 1), f"{path}.format")
            problem = check_format(found, *cls.FORMAT)
            if problem is None and found < cls.FORMAT[0]:
                problem = MIGRATIONS[cls.FORMAT[2]][found](data)
            if problem is not None:
                raise ProtocolError(f"{path}.format", found, problem)
            data = {**data, "format": cls.FORMAT[0]}  # migrated: the record is this format's from now on
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ProtocolError(f"{path}.{unknown[0]}", data[unknown[0]], "unknown field; known: " + ", ".join(fields))
        kwargs = {}
        for name, f in fields.items():
            if name in data:
                kwargs[name] = _decode(hints[name], data[name], f"{path}.{name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{path}.{name}", None, "required field missing")
        record = cls(**kwargs)
        problem = record.check()
        if problem is not None:
            name, expected = problem
            raise ProtocolError(f"{path}.{name}", getattr(record, name), expected)
        return record

    def check(self) -> tuple[str, str] | None:
        """(field, what is expected) for a record whose fields are well-typed but inconsistent; None if fine."""
        return None


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


# ---- weight versions ------------------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class VersionRef(Record):
    """A published weight version. Every trainer start from a checkpoint begins a new lineage whose version
    numbers continue from the checkpoint's step, so a number alone can name weights of a dead lineage; the pair
    cannot. Ordered by lineage, then version: the order the store's LATEST moves in."""

    lineage: int
    version: int

    def check(self) -> tuple[str, str] | None:
        if self.lineage < 0:
            return "lineage", "must be >= 0"
        if self.version < 0:
            return "version", "must be >= 0"
        return None


def staleness_ok(trainer: VersionRef, sample: VersionRef, max_staleness: int,
                 forks: dict[int, VersionRef] | None = None) -> bool:
    """The rule for training a sample at trainer version `trainer.version` (= the step): the sample's weights
    are in the trainer's history, at most `max_staleness` steps old and never newer than the trainer's (a server
    still holding a dead lineage's higher version must not feed the step).

    `forks` maps a lineage to where it began: a trainer resumed from the checkpoint of step k of lineage L-1
    starts lineage L at k, so versions <= k of L-1 are the same weights (its history) and versions > k of L-1
    are the dead lineage's. Without `forks` only the trainer's own lineage counts."""
    if not 0 <= trainer.version - sample.version <= max_staleness:
        return False
    lineage, bound = trainer.lineage, trainer.version
    while sample.lineage != lineage:
        fork = (forks or {}).get(lineage)
        if fork is None:
            return False
        lineage, bound = fork.lineage, min(bound, fork.version)
    return sample.version <= bound


@dataclass(frozen=True)
class VersionSpan(Record):
    """`tokens` consecutive tokens of a completion sampled with the weights (lineage, version). A completion's
    spans are in token order and cover every token (check_spans); a server that swaps weights between decode
    steps (rollout.weight_swap: inflight) gives a row that ran across a swap one span per version, a draining one
    always one."""

    lineage: int
    version: int
    tokens: int

    @property
    def ref(self) -> VersionRef:
        return VersionRef(self.lineage, self.version)

    def check(self) -> tuple[str, str] | None:
        if self.tokens < 1:
            return "tokens", "must be >= 1 (a span holds at least one token)"
        return self.ref.check()


def check_spans(spans: list[VersionSpan], token_ids: list[int]) -> tuple[str, str] | None:
    """A completion's spans: their tokens add up to its tokens, and each span's weights are newer than the one
    before (a server's versions only move forward, and equal neighbours are one span)."""
    if sum(s.tokens for s in spans) != len(token_ids):
        return "versions", f"spans whose tokens add up to the completion's {len(token_ids)} tokens"
    if any(a.ref >= b.ref for a, b in zip(spans, spans[1:])):
        return "versions", "spans in token order, each of newer weights (lineage, version) than the one before"
    return None


def one_version(ref: VersionRef, tokens: int) -> list[VersionSpan]:
    """The spans of `tokens` tokens all sampled with `ref` (a drained server's row, or data no server sampled)."""
    return [VersionSpan(ref.lineage, ref.version, tokens)] if tokens else []


def first_tokens(spans: list[VersionSpan], n: int) -> list[VersionSpan]:
    """The spans of a completion's first `n` tokens (a completion cut at a stop string keeps those)."""
    out = []
    for span in spans:
        if n <= 0:
            break
        out.append(span if span.tokens <= n else dataclasses.replace(span, tokens=n))
        n -= span.tokens
    return out


def tokens_trainable(trainer: VersionRef, spans: list[VersionSpan], max_staleness: int,
                     forks: dict[int, VersionRef] | None = None) -> bool:
    """The staleness rule for a sample whose tokens come from several versions: every span must pass
    `staleness_ok`, so the oldest token's version bounds the sample's staleness (trainer step - oldest version <=
    max_staleness), no token is newer than the trainer, and each span's lineage is in the trainer's history."""
    return all(staleness_ok(trainer, s.ref, max_staleness, forks) for s in spans)


def sample_staleness(step: int, spans: list[VersionSpan]) -> int:
    """A sample's staleness at `step`: how many steps its oldest token's version lags (0 without tokens)."""
    return max((step - s.version for s in spans), default=0)


# ---- routing replay -------------------------------------------------------------------------------------------
ROUTING_DTYPES = {"uint8": 1, "int16": 2}  # name -> bytes per id: uint8 while every id fits (experts <= 256)
ROUTING_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")
CHECKSUM_HEX = re.compile(r"^[0-9a-f]{16}$")


def routing_dtype(num_experts: int) -> str:
    """The narrowest id type for `num_experts` experts (vLLM's width): uint8 up to 256, else int16."""
    if not 1 <= num_experts <= 32768:
        raise ProtocolError("num_experts", num_experts, "between 1 and 32768 (int16 expert ids)")
    return "uint8" if num_experts <= 256 else "int16"


@dataclass(frozen=True)
class RoutingRef(Record):
    """Where one choice's routed expert ids are (routing replay): the object `key` in the run's routing store
    (workloads/rl/routing_store.py; its root comes from the run, rl.routing, never from the wire), holding a
    C-order array of `shape` [prompt + completion - 1 positions, layers, k] of `dtype`, `bytes` long as stored
    (after `compression`), whose XXH3-64 is `checksum`. The key is unique per server answer and choice; a
    sample's id (`<request>/<choice>`) is the orchestrator's, not the store's."""

    key: str
    dtype: Literal["uint8", "int16"]
    shape: tuple[int, ...]  # [positions, layers, k]
    bytes: int
    checksum: str  # XXH3-64 of the stored bytes, 16 hex digits
    compression: Literal["none", "zlib"] = "none"

    @property
    def array_bytes(self) -> int:
        """The array's size once decompressed."""
        return math.prod(self.shape) * ROUTING_DTYPES[self.dtype]

    def check(self) -> tuple[str, str] | None:
        if not ROUTING_KEY.match(self.key):
            return "key", "1-200 letters, digits, '_', '.', '-' (a name in the routing store, no path)"
        if len(self.shape) != 3 or self.shape[0] < 0 or self.shape[1] < 1 or self.shape[2] < 1:
            return "shape", "[positions >= 0, layers >= 1, k >= 1]"
        if self.bytes < 0 or (self.compression == "none" and self.bytes != self.array_bytes):
            return "bytes", f"the stored size: {self.array_bytes} for {self.dtype}{list(self.shape)} uncompressed"
        if not CHECKSUM_HEX.match(self.checksum):
            return "checksum", "16 lowercase hex digits (XXH3-64)"
        return None


def routing_positions(routing: RoutingRef | None, prompt: int, completion: int) -> tuple[str, str] | None:
    """A sample's routing covers every fed position: prompt + completion[:-1]."""
    if routing is not None and routing.shape[0] != prompt + completion - 1:
        return "routing", (f"routing of prompt + completion - 1 = {prompt + completion - 1} positions (it covers "
                           f"{routing.shape[0]})")
    return None


# ---- seeds ----------------------------------------------------------------------------------------------------
def derive_seed(run_seed: int, *counters: int) -> int:
    """A request's seed in [0, 2**63) as a hash of (run seed, counters...) (e.g. the prompt index): counter-based
    like Philox, so nearby run seeds and indices never collide the way `seed * 100_000 + i` does, and the same
    request retried anywhere samples the same completions."""
    for name, value in (("run_seed", run_seed), *((f"counters[{i}]", c) for i, c in enumerate(counters))):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
            raise ProtocolError(name, value, "expected an integer in [0, 2**64)")
    data = b"".join(v.to_bytes(8, "little") for v in (run_seed, *counters))
    digest = hashlib.blake2b(data, digest_size=8, person=b"moerl-seed").digest()
    # Derived seeds stay below 2**63 (inside SEED_LIMIT) so that readers with signed 64-bit integers take them too.
    return int.from_bytes(digest, "little") % 2**63


# ---- rollouts -------------------------------------------------------------------------------------------------
def one_logprob_per_token(logprobs: list[float], token_ids: list[int]) -> tuple[str, str] | None:
    if len(logprobs) != len(token_ids):
        return "logprobs", f"one per completion token ({len(token_ids)} token ids)"
    return None


@dataclass(frozen=True)
class Choice(Record):
    """One completion of a response, as the orchestrator keeps it."""

    index: int
    token_ids: list[int]
    logprobs: list[float]  # of each token in token_ids, in the request's logprob_mode
    finish_reason: FinishReason
    versions: list[VersionSpan]  # the weights of each token (check_spans)
    text: str = ""
    routing: RoutingRef | None = None  # [prompt + completion - 1, layers, k] in the routing store

    def check(self) -> tuple[str, str] | None:
        return one_logprob_per_token(self.logprobs, self.token_ids) or check_spans(self.versions, self.token_ids)


@dataclass(frozen=True)
class Completion(Record):
    """A rollout server's answer: `version` is the oldest weights any of its tokens was sampled with (each choice's
    `versions` say which token came from which)."""

    version: VersionRef
    choices: list[Choice]
    lineage_reported: bool = True  # False: the server named no lineage (version.lineage is 0 until attributed)


# ---- training data --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptRecord(Record):
    """A prompt as the orchestrator keeps it while its request is in flight (checkpointed, so a restarted
    orchestrator asks for the same prompt with the same seed)."""

    index: int  # unique in a run; the request seed derives from it
    prompt_ids: list[int]
    text: str
    ground_truth: Any  # what the reward checks against (JSON)
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # the prompt's own completion cap; None: rl.sampling.max_tokens


@dataclass(frozen=True)
class Sample(Record):
    """One scored completion of a group."""

    completion_ids: list[int]
    logprobs: list[float]  # behaviour policy's, one per completion token
    reward: float
    finished: bool  # ended by EOS/stop, not cut by max_tokens
    versions: list[VersionSpan]  # the weights that sampled its tokens (check_spans)
    routing: RoutingRef | None = None

    def check(self) -> tuple[str, str] | None:
        return one_logprob_per_token(self.logprobs, self.completion_ids) or check_spans(self.versions,
                                                                                        self.completion_ids)


@dataclass(frozen=True)
class Group(Record):
    """One prompt's scored completions (those whose reward did not fail); `version` is its answer's (the oldest
    weights of any token), each sample's `versions` say which weights sampled which of its tokens."""

    request_id: str
    prompt_index: int
    prompt_ids: list[int]
    version: VersionRef
    samples: list[Sample]


def request_id(prompt_index: int) -> str:
    """The orchestrator's request id of the prompt drawn as `prompt_index` (unique per draw in a run)."""
    return f"p{prompt_index}"


def prompt_index(request: str) -> int | None:
    """The prompt index a request id names; None for a string that is not one."""
    digits = request[1:]
    if not (digits.isascii() and digits.isdigit() and len(digits) < 19):
        return None
    return int(digits) if request_id(int(digits)) == request else None  # the one spelling request_id gives


def sample_id(request: str, choice: int) -> str:
    return f"{request}/{choice}"


def request_of(sample: str) -> str:
    """The request id of a sample id (sample_id's inverse on its first part)."""
    return sample.split("/")[0]


@dataclass(frozen=True)
class TrainingSample(Record):
    """What a trainer rank trains on: one completion with its advantage. Its behaviour logprobs are per token, each
    under the weights its span of `versions` names, which is what the decoupled objective's importance weights
    divide by (rl/losses.py, policy_objective)."""

    id: str  # sample_id(request id, choice): unique in a run, so accounting can prove nothing is trained twice
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    advantage: float  # sequence-level (the algorithm's sequence_advantages); PPO's are 0 and made by the trainer
    finished: bool
    versions: list[VersionSpan]  # the weights that sampled its tokens (check_spans)
    routing: RoutingRef | None = None  # routing replay: read from the store by the rank that trains it

    def check(self) -> tuple[str, str] | None:
        return (one_logprob_per_token(self.logprobs, self.completion_ids)
                or check_spans(self.versions, self.completion_ids)
                or routing_positions(self.routing, len(self.prompt_ids), len(self.completion_ids)))


@dataclass(frozen=True)
class BatchStats(Record):
    reward_mean: float
    accuracy: float
    staleness_mean: float  # of its samples, each by its oldest token (sample_staleness)
    dropped_stale_groups: int
    filtered_groups: int
    retries: int
    rewards_failed: int  # samples whose reward failed (masked, never trained)
    completed: int


@dataclass(frozen=True)
class Batch(Record):
    """The samples of one optimizer step (trainer version `step` of `lineage`), in prompt order. A sample may
    come from an older lineage's versions that are in `lineage`'s history (before the checkpoint it resumed
    from)."""

    step: int
    lineage: int
    samples: list[TrainingSample]
    stats: BatchStats
    format: int = WIRE_FORMAT  # of the orchestrator that formed it (read without one: format 1)
    FORMAT: ClassVar[tuple[int, str, str]] = (WIRE_FORMAT, "batch", "wire")

    def check(self) -> tuple[str, str] | None:
        if not self.samples:
            return "samples", "at least one sample"
        return None


@dataclass(frozen=True)
class OrchestratorState(Record):
    """What a checkpoint records of the orchestrator; a restarted one resumes from it. `format` says which layout
    wrote it (STATE_FORMAT): a state from before formats were recorded reads as format 1; an older or a newer
    format is refused, never misread (check_format)."""

    next_prompt: int
    consumed: int  # groups that went into batches
    pending: list[PromptRecord]  # in flight when the snapshot was taken: issued again, with the same seeds
    buffered: list[Group]
    batches: dict[int, Batch]  # by step, kept until the trainer has committed a checkpoint past them
    counts: dict[str, int]
    trainer: VersionRef | None = None  # the trainer's version when the snapshot was taken
    forks: dict[int, VersionRef] = field(default_factory=dict)  # lineage -> where it began (staleness_ok)
    source: dict[str, Any] = field(default_factory=dict)  # the prompt source's own state (its cursor)
    first_step: int | None = None  # the step of the first batch formed
    # prompts (by index) that a trainer trained in steps this state never recorded, not yet drawn from the source:
    # skipped when drawn (a catch-up: orchestrator/buffer.py GroupBuffer.catch_up)
    trained_ahead: list[int] = field(default_factory=list)
    # the state file's alone (never a checkpoint's: every checkpoint after a catch-up retires it): the state from
    # before a catch-up, for a trainer that resumes from the checkpoint older than it (orchestrator/driver.py)
    held: HeldState | None = None
    format: int = STATE_FORMAT  # read without one: format 1
    FORMAT: ClassVar[tuple[int, str, str]] = (STATE_FORMAT, "orchestrator state", "state")

    def check(self) -> tuple[str, str] | None:
        if self.held is not None and self.held.state.held is not None:
            return "held", "one state from before a catch-up, which holds none itself"
        return None


@dataclass(frozen=True)
class HeldState(Record):
    """The state before a catch-up (its next step to form, the trainer's lineage then), held until a checkpoint at
    or past `until`, the step caught up to, is committed."""

    state: OrchestratorState
    next_step: int
    lineage: int
    until: int
