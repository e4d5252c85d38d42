"""The rollout engine's request and result types (README, "Architecture": the engine behind the rollout server).
Torch-free, so the HTTP protocol modules can import them; `engine.py` re-exports them next to the RolloutEngine
that consumes them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy

from moe_rl_eks.core import sampling as limits
from moe_rl_eks.core.sampling import LOGPROB_MODES

from ..rl.protocol import VersionSpan


def _bad(name: str, value, allowed: str) -> ValueError:
    return ValueError(f"{name}: {value!r} is not allowed; {allowed}")


def _check(limit: limits.Limit, value) -> None:
    if not limit.allows(value):
        raise _bad(limit.name, value, limit.allowed())


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one row samples. Validated on construction against the one set of limits (core/sampling.py): a
    ValueError names the field, the value and what is allowed. The filters apply in vLLM's order: temperature,
    top-k, top-p (of what top-k kept), min-p."""

    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # 0 <= seed < 2**64; None = fresh entropy, drawn when the row is submitted
    stop_token_ids: tuple[int, ...] = ()  # the model's EOS ids are added by the engine
    logprob_mode: Literal["processed", "raw"] = "processed"  # processed = of the distribution sampled from
    top_logprobs: int = 0  # alternatives per token (0 = only the sampled token's logprob)
    return_routing: bool = False
    # The prompt's tokens' logprobs too (OpenAI's echo with logprobs), computed from the prefill, with top_logprobs
    # alternatives each. Under the model's own distribution (softmax of the logits) whatever logprob_mode says: no
    # prompt token was sampled, so there is no processed distribution it was drawn from.
    prompt_logprobs: bool = False
    # vLLM's ignore_eos: the row runs to max_tokens through the model's EOS ids (stop_token_ids still stop it); what
    # a throughput benchmark on random weights needs, whose lengths are drawn, not sampled.
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for limit in (limits.MAX_TOKENS, limits.TEMPERATURE, limits.TOP_P, limits.TOP_K, limits.MIN_P):
            _check(limit, getattr(self, limit.name))
        if self.seed is not None:
            _check(limits.SEED, self.seed)
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "a tuple of non-negative token ids")
        if self.logprob_mode not in LOGPROB_MODES:
            raise _bad("logprob_mode", self.logprob_mode, f"one of {', '.join(LOGPROB_MODES)}")
        _check(limits.TOP_LOGPROBS, self.top_logprobs)
        if not isinstance(self.return_routing, bool):
            raise _bad("return_routing", self.return_routing, "true or false")
        if not isinstance(self.prompt_logprobs, bool):
            raise _bad("prompt_logprobs", self.prompt_logprobs, "true or false")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "true or false")

    def stop_ids(self, eos_ids: frozenset[int] | tuple[int, ...]) -> frozenset[int]:
        """The ids that end this row, given the model's EOS ids."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_ids))


@dataclass(frozen=True)
class RowRequest:
    """One completion (choice `row` of request `request_id`) of a prompt."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str
    row: int  # choice index within the request (0..n-1): part of the row's seed counter

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_ids, tuple) or not self.prompt_ids or not all(
                _is_int(t) and t >= 0 for t in self.prompt_ids):
            raise _bad("prompt_ids", self.prompt_ids, "a non-empty tuple of non-negative token ids")
        if not _is_int(self.row) or not 0 <= self.row < 2 ** 32:
            raise _bad("row", self.row, "an integer in [0, 2**32)")


@dataclass
class TokenEvent:
    """One sampled token, streamed from the engine thread as it is sampled."""

    request_id: str
    row: int
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class RowOutput:
    request_id: str
    row: int
    token_ids: list[int]  # includes the EOS/stop token that ended the row
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: Literal["stop", "length", "abort", "error"]
    error: str | None  # set when finish_reason == "error" (this row alone failed)
    # expert ids [prompt + completion - 1, layers, k] (vLLM's layout): uint8 when experts <= 256, else int16
    routing: "numpy.ndarray | None"
    weight_version: int
    weight_lineage: int = 0  # with weight_version: the published version (protocol.VersionRef) served as it ended
    # with params.prompt_logprobs: one per prompt token, the first None (nothing precedes it), and the alternatives
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # The weights of each token in order (protocol.check_spans): more than one span when versions were swapped in
    # while the row ran; empty without tokens, or from a decoder run outside a replica (decode_all: no version).
    weight_versions: list[VersionSpan] = field(default_factory=list)

    @property
    def oldest(self) -> tuple[int, int]:
        """(lineage, version) of its oldest token's weights, or of the weights it ended on without tokens."""
        first = self.weight_versions[0] if self.weight_versions else None
        return (first.lineage, first.version) if first else (self.weight_lineage, self.weight_version)


@dataclass
class EngineHealth:
    version: int | None
    running_rows: int  # rows holding a KV-cache slot (prefilling or decoding)
    waiting_rows: int  # rows submitted but not yet admitted
    last_step_monotonic: float  # time.monotonic() when the engine loop last finished a step or idled
    lineage: int | None = None  # the served version's lineage (protocol.VersionRef)
    row_tokens_per_s: float | None = None  # each running row's decode rate over recent steps; None before any
