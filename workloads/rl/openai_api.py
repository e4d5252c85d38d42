"""The rollout servers' HTTP API: OpenAI's completion and chat-completion protocol as pydantic models, plus the
fields RL clients add (vLLM's `return_token_ids`, `stop_token_ids`, `top_k`, `min_p`, `logprob_mode`; our
`return_routing`: each choice then carries `routing_ref`, a reference to its routed experts in the run's routing
store, never the arrays). The one vocabulary of that wire: the server (workloads/rollout/server.py) accepts and answers
these models, and the orchestrator and the evaluation send the same `CompletionRequest` and read the same
`CompletionResponse` (`read_completion`). Torch-free: the orchestrator, clients and tests import it without the
model.

Requests are validated strictly (`"n": "3"` and `"n": true` are errors, not coerced) and every number must be
finite, so nothing the schema lets through can fail a batch on its type or range. Fields that depend on the
served model (vocabulary, context length, `max_n`) are checked by the server against its run configuration.
Unknown request fields are kept in `model_extra`, which the server logs and ignores, as vLLM does. `null` means
"the default" for every optional field, as in OpenAI's API.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from moe_rl_eks.core import sampling as limits
from moe_rl_eks.core.sampling import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS

from .protocol import Choice, Completion, ProtocolError, VersionRef

Finite = Annotated[float, Field(allow_inf_nan=False)]


def _integral(value):
    # JSON Schema's integers include 3.0 (and JavaScript clients write them so); "3" and true stay errors.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds):
    """An integer field type with bounds (placed before the validator, so the JSON schema states them)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]
LogprobMode = Literal[limits.LOGPROB_MODES]
FinishReason = Literal["stop", "length", "abort"]


class Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool | None = None


class SamplingFields(Request):
    """What both endpoints share: how rows are sampled and what comes back with them."""

    model: str | None = None
    n: integer(ge=1) | None = Field(None, description="choices per prompt (<= the server's max_n)")
    max_tokens: integer(**limits.MAX_TOKENS.bounds()) | None = None
    temperature: Annotated[Finite, Field(**limits.TEMPERATURE.bounds())] | None = Field(
        None, description="0 = greedy; default 1")
    top_p: Annotated[Finite, Field(**limits.TOP_P.bounds())] | None = None
    top_k: integer(ge=-1) | None = Field(None, description="-1 (vLLM's) or 0 (the engine's) = off")
    min_p: Annotated[Finite, Field(**limits.MIN_P.bounds())] | None = None
    seed: integer(**limits.SEED.bounds()) | None = Field(
        None, description="choice i samples from the counter-based stream (seed, i): the same request reproduces")
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="the text ends before the first of these strings")
    stop_token_ids: list[integer(ge=0)] | None = None
    ignore_eos: bool | None = Field(None, description="vLLM's: run to max_tokens through the model's EOS ids")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = Field(None, description="also return the prompt's token ids")
    return_routing: bool | None = Field(None, description="write each choice's routed experts to the run's routing "
                                                          "store and answer a reference to them (routing replay)")
    logprob_mode: LogprobMode | None = Field(
        None, description="processed = after temperature/top-k/top-p/min-p (what an RL trainer scores); "
                          "raw (default) = the model's own distribution")

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


TokenIds = Annotated[list[integer(ge=0)], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = Field(
        None, description="0 = the sampled token's logprob; N = also the N most likely alternatives")
    echo: bool | None = None

    def to_json(self) -> dict:
        """The request body as sent: fields left at None are left out (`null` means the default anyway)."""
        return self.model_dump(exclude_none=True)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: OpenAI accepts a string, token ids, or a list of either."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: integer(ge=1) | None = Field(None, description="OpenAI's newer max_tokens")
    logprobs: bool | None = None
    top_logprobs: integer(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    add_generation_prompt: bool | None = Field(None, description="end the prompt with the assistant's turn "
                                                                 "(default true)")


# ---- responses -----------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Versioned(BaseModel):
    """Every answer says which weights sampled it: `weight_version` the oldest of any of its tokens, each choice's
    `weight_versions` which token came from which (a server swapping weights between decode steps may change
    them under a running row)."""
    id: str
    created: int
    model: str
    weight_version: int
    weight_lineage: int | None = None  # None only from servers that predate lineages
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class WeightSpan(BaseModel):
    """`tokens` consecutive tokens of a choice sampled with weights `version` of `lineage` (protocol.VersionSpan)."""
    version: int
    lineage: int
    tokens: int


WeightSpans = Field(None, description="the weights of the choice's tokens, in order: spans of (version, lineage, "
                                      "tokens) covering every token; one span unless weights were swapped mid-row")
# Read as protocol.RoutingRef (read_completion), which names any bad field: one definition of the reference.
RoutingRefField = Field(None, description="with return_routing: where the choice's routed experts are in the run's "
                                          "routing store: {key, dtype (uint8 | int16), shape [prompt + completion - 1, "
                                          "layers, k], bytes, checksum (XXH3-64), compression}")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    stop_reason: int | str | None = Field(None, description="the stop token id or string that ended the choice")
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    routing_ref: dict[str, Any] | None = RoutingRefField
    weight_versions: list[WeightSpan] | None = WeightSpans


class CompletionResponse(Versioned):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoiceFields(BaseModel):
    """What a chat choice carries whole or streamed."""
    index: int
    stop_reason: int | str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None
    routing_ref: dict[str, Any] | None = RoutingRefField
    weight_versions: list[WeightSpan] | None = WeightSpans


class ChatChoice(ChatChoiceFields):
    message: AssistantMessage
    finish_reason: FinishReason
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponse(Versioned):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatChunkChoice(ChatChoiceFields):
    delta: Delta
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(Versioned):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moe-rl-eks"
    max_model_len: int
    weight_version: int | None
    weight_lineage: int | None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class WeightLoadRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    version: integer(ge=0)
    lineage: integer(ge=0) | None = Field(
        None, description="the trainer lineage the version belongs to (default: the store's newest)")


class WeightLoadResponse(BaseModel):
    weight_version: int
    weight_lineage: int
    load_seconds: float


# The per-row decode rate a server measures (tokens per second each running row gets, over recent decode steps;
# None before its first): clients derive request deadlines from it (core/deadlines.py).
RowRate = Annotated[float, Field(gt=0, allow_inf_nan=False)] | None


class Health(BaseModel):
    status: Literal["ok", "hung"]
    weight_version: int | None
    running: int
    waiting: int
    seconds_since_step: float
    row_tokens_per_s: RowRate = None


class Readiness(BaseModel):
    ready: bool
    weight_version: int | None
    weight_lineage: int | None
    row_tokens_per_s: RowRate = None


def read_completion(body: object, path: str = "response") -> Completion:
    """A completions response as the orchestrator keeps it: read as the server wrote it (`CompletionResponse`),
    every choice with its token ids and one logprob per token. A malformed answer raises ProtocolError naming
    the field."""
    try:
        response = CompletionResponse.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        raise ProtocolError(f"{path}{where}", first.get("input"), first["msg"]) from None
    choices = []
    for i, c in enumerate(response.choices):
        where = f"{path}.choices[{i}]"
        if c.logprobs is None:
            raise ProtocolError(f"{where}.logprobs", None, "expected an object with token_logprobs")
        if c.weight_versions is None:
            raise ProtocolError(f"{where}.weight_versions", None, "expected the weights of every token (spans of "
                                "version, lineage, tokens), which servers of wire format 2 on return: upgrade the "
                                "rollout server")
        choices.append(Choice._from_json({
            "index": c.index, "token_ids": c.token_ids, "logprobs": c.logprobs.token_logprobs,
            "finish_reason": c.finish_reason, "text": c.text, "routing": c.routing_ref,
            "versions": [w.model_dump() for w in c.weight_versions]}, where))
    if sorted(c.index for c in choices) != list(range(len(choices))):
        raise ProtocolError(f"{path}.choices", [c.index for c in choices], "indices 0..n-1, each once")
    if not choices:
        raise ProtocolError(f"{path}.choices", [], "expected a non-empty list")
    reported = response.weight_lineage is not None
    return Completion(VersionRef(response.weight_lineage if reported else 0, response.weight_version),
                      sorted(choices, key=lambda c: c.index), reported)
