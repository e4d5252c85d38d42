"""Rollout server: OpenAI's completions and chat-completions API over the RolloutEngine, on FastAPI + uvicorn.

  POST /v1/completions, /v1/chat/completions  OpenAI's fields, vLLM's (top_k, min_p, stop_token_ids,
        return_token_ids, logprob_mode) and ours (return_routing: each choice's routed experts are written to the
        run's routing store and the choice carries `routing_ref`, a reference to them, for routing replay);
        `stream: true` answers server-sent events as tokens are sampled. Every answer carries weight_version and
        weight_lineage (the oldest weights that sampled any of its tokens), and each choice weight_versions: spans
        of (version, lineage, tokens) in token order (rollout.weight_swap: inflight swaps under running rows).
  GET  /v1/models, /openapi.json, /health (liveness: 503 once the engine loop is hung), /ready (200 once weights
       are loaded), /metrics (Prometheus)
  POST /v1/weights/load {"version", "lineage"} (Authorization: Bearer <token>): fetch and swap in a published
       version; 409 when it cannot be loaded (the served weights stay as they were)

Every value is checked before it reaches the engine (the pydantic models of openai_protocol, then the served
model's limits here), so no request can fail a batch; a row that still fails inside the engine fails alone. Only
a request that reads its tokens as they come (a stream, or stop strings to find) gets them from the engine's thread,
once per engine step, handed to the event loop in bursts; any other request costs the loop nothing per token (the
engine counts tokens and their latencies itself) and waits for its result. A client that disconnects has its rows
cancelled.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

from moe_rl_eks.core import metrics as M
from moe_rl_eks.core.run import RunConfig

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..rl import openai_api as api
from ..rl.protocol import RoutingRef, VersionRef, first_tokens
from ..rl.routing_store import RoutingStore
from ..rl.runtime import HttpError, Registry, json_api
from ..rl.tokenizer import Tokenizer, UnknownText
from .detokenizer import CompletionText
from .engine_api import EngineHealth, RowOutput, RowRequest, SamplingParams, TokenEvent

log = logging.getLogger(__name__)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits


@dataclass(frozen=True)
class Plan:
    """A request that passed every check: its prompts as token ids and how each of their rows samples."""

    kind: Literal["completion", "chat"]
    prompts: list[tuple[int, ...]]
    params: list[SamplingParams]  # per prompt (the default max_tokens depends on the prompt's length)
    n: int
    stops: tuple[str, ...]
    logprobs: int | None  # None = no logprobs; else alternatives per token
    echo: bool
    return_token_ids: bool
    stream: bool
    include_usage: bool

    def rows(self, request_id: str) -> list[RowRequest]:
        # Choice p*n + j is row p*n + j: its seed counter, so a retried request reproduces every choice.
        return [RowRequest(prompt, self.params[p], request_id, p * self.n + j)
                for p, prompt in enumerate(self.prompts) for j in range(self.n)]


class ServedModel:
    """The served model's limits, which the request schema cannot know, and its tokenizer."""

    def __init__(self, run: RunConfig, tokenizer: Tokenizer) -> None:
        self.name, self.tokenizer = run.name, tokenizer
        self.vocab_size, self.context = run.model.vocab_size, run.model.max_position_embeddings
        self.max_new_tokens, self.max_rows = run.rollout.max_new_tokens, run.rollout.max_batch_size
        s = run.rl.sampling
        self.max_prompt_tokens, self.max_n = s.max_prompt_tokens, s.max_n
        # Every id that ends a row (the engine adds them to each row's stop ids): never part of the text.
        self.eos_ids = tuple(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))
        self._texts: dict[int, str] = {}  # token id -> its text alone, as logprobs show it (at most the vocabulary)

    def token_text(self, token: int) -> str:
        """A token's text on its own (logprobs' `tokens`): decoded once per id, as a real tokenizer's decode call
        costs microseconds and an RL response lists thousands of tokens."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise HttpError(404, f"model: {model!r} is not served here; this server serves {self.name!r}", "model",
                            "model_not_found")

    def prompt_ids(self, prompt: str | list[int], field: str) -> tuple[int, ...]:
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except UnknownText as exc:
                raise HttpError(400, f"{field}: {exc}", field) from None
        else:
            ids = prompt
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise HttpError(400, f"{field}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                field)
        if not 1 <= len(ids) <= self.max_prompt_tokens:
            raise HttpError(400, f"{field}: {len(ids)} tokens; allowed 1..{self.max_prompt_tokens}", field)
        return tuple(ids)

    def chat_prompt_ids(self, messages: list[api.ChatMessage], add_generation_prompt: bool) -> tuple[int, ...]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise HttpError(400, f"messages: model {self.name!r} has no chat template; send a prompt to "
                                 "/v1/completions instead", "messages", "no_chat_template")
        turns = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 -- a template's raise_exception or a jinja error: the messages' fault
            raise HttpError(400, f"messages: the chat template refused them: {exc}", "messages") from None
        return self.prompt_ids(text, "messages")

    def plan(self, kind: Literal["completion", "chat"], req: api.SamplingFields, prompts: list[tuple[int, ...]],
             max_tokens: int | None, default_max_tokens: int, logprobs: int | None, echo: bool) -> Plan:
        """`echo` with `logprobs`: the prompt's tokens are scored too (their logprobs from the prefill)."""
        self.check_model(req.model)
        n = 1 if req.n is None else req.n
        if n > self.max_n:
            raise HttpError(400, f"n: {n} is outside 1..{self.max_n}", "n")
        if len(prompts) > self.max_rows:
            raise HttpError(400, f"prompt: {len(prompts)} prompts; at most {self.max_rows} per request", "prompt")
        bad = [t for t in req.stop_token_ids or () if t >= self.vocab_size]
        if bad:
            raise HttpError(400, f"stop_token_ids: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.vocab_size})", "stop_token_ids")
        top_k = 0 if req.top_k in (None, -1) else req.top_k
        if top_k > self.vocab_size:
            raise HttpError(400, f"top_k: {top_k} exceeds the vocabulary size {self.vocab_size}", "top_k")
        if logprobs is not None and logprobs > self.vocab_size:
            raise HttpError(400, f"logprobs: {logprobs} alternatives exceed the vocabulary size {self.vocab_size}",
                            "logprobs")
        params = []
        for ids in prompts:
            room = self.context - len(ids)
            if max_tokens is None:
                wanted = min(default_max_tokens, self.max_new_tokens, room)
                if wanted < 1:
                    raise HttpError(400, f"prompt: {len(ids)} tokens leave no room in the model's {self.context} "
                                         "positions", "prompt")
            else:
                wanted = max_tokens
                if wanted > self.max_new_tokens:
                    raise HttpError(400, f"max_tokens: {wanted} is outside 1..{self.max_new_tokens}", "max_tokens")
                if wanted > room:
                    raise HttpError(400, f"max_tokens: prompt ({len(ids)}) + max_tokens ({wanted}) exceeds the "
                                         f"model's {self.context} positions", "max_tokens")
            try:
                params.append(SamplingParams(
                    max_tokens=wanted, temperature=1.0 if req.temperature is None else float(req.temperature),
                    top_p=1.0 if req.top_p is None else float(req.top_p), top_k=top_k,
                    min_p=0.0 if req.min_p is None else float(req.min_p), seed=req.seed,
                    stop_token_ids=tuple(req.stop_token_ids or ()), logprob_mode=req.logprob_mode or "raw",
                    top_logprobs=logprobs or 0, return_routing=bool(req.return_routing),
                    prompt_logprobs=echo and logprobs is not None, ignore_eos=bool(req.ignore_eos)))
            except ValueError as exc:  # the engine's own limits, stricter than the protocol's
                field = str(exc).split(":", 1)[0]
                raise HttpError(400, str(exc), field) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Plan(kind, prompts, params, n, req.stop_strings(), logprobs, echo, bool(req.return_token_ids),
                    bool(req.stream), include_usage)

    def completion_plan(self, req: api.CompletionRequest) -> Plan:
        if req.echo and req.logprobs is not None and req.stream:
            raise HttpError(400, "stream: echo with logprobs is answered whole (the prompt's logprobs come with the "
                                 "answer); send stream false, or echo without logprobs", "stream")
        many = len(req.prompts()) > 1
        prompts = [self.prompt_ids(p, f"prompt[{i}]" if many else "prompt") for i, p in enumerate(req.prompts())]
        return self.plan("completion", req, prompts, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, req.logprobs,
                         bool(req.echo))

    def chat_plan(self, req: api.ChatCompletionRequest) -> Plan:
        if req.top_logprobs and not req.logprobs:
            raise HttpError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        prompt = self.chat_prompt_ids(req.messages, req.add_generation_prompt is not False)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return self.plan("chat", req, [prompt], max_tokens, self.max_new_tokens, logprobs, False)


class RolloutMetrics:
    """The server's request metrics, in the engine's registry: one /metrics shows both (the engine counts
    generated tokens, time to first token, inter-token latency and busy seconds, and sets the served version)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.requests, self.errors = self.registry[M.ROLLOUT_REQUESTS], self.registry[M.ROLLOUT_REQUEST_ERRORS]
        self.prompt_tokens = self.registry[M.ROLLOUT_PROMPT_TOKENS]
        self.finished = self.registry[M.ROLLOUT_REQUEST_SUCCESS]
        self.e2e = self.registry[M.ROLLOUT_E2E_LATENCY]
        self.running, self.waiting = self.registry[M.ROLLOUT_RUNNING], self.registry[M.ROLLOUT_WAITING]
        self.lineage = self.registry[M.ROLLOUT_WEIGHT_LINEAGE]


class StreamedChoice:
    """One choice on the event loop: its text (stop strings, as tokens arrive when someone reads along) and
    streamed offsets."""

    def __init__(self, server: "RolloutServer", plan: Plan, index: int) -> None:
        self.prompt = plan.prompts[index // plan.n]
        self.text = CompletionText(server.model.tokenizer, plan.stops,
                                   tuple(plan.params[index // plan.n].stop_ids(server.model.eos_ids)),
                                   incremental=plan.stream)
        self.offset = 0  # characters of token strings streamed so far (logprobs.text_offset)

    @property
    def stopped(self) -> bool:
        return self.text.stopped_by is not None


class TokenRelay:
    """Sampled tokens from the engine thread to the event loop: the engine hands over each request's tokens of a
    step (its `on_tokens`), and wakes the loop only when no hand-over is already pending, so a step costs at most
    one wake-up (one GIL hand-over between the two threads), however many requests and rows it served. Locking
    rule: `_bursts` and `_pending` only under `_lock`; `listeners` only on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.listeners: dict[str, Callable[[list[TokenEvent]], None]] = {}  # request id -> its Generation's handler
        self._bursts: list[list[TokenEvent]] = []  # one request's tokens of one step each
        self._pending = False
        self._lock = threading.Lock()

    def put(self, events: list[TokenEvent]) -> None:
        """The engine's on_tokens (engine thread)."""
        with self._lock:
            self._bursts.append(events)
            if self._pending:
                return
            self._pending = True
        self.loop.call_soon_threadsafe(self.deliver)

    def deliver(self) -> None:
        """On the loop: hand each request its waiting tokens, in order (a request already gone drops its tokens)."""
        with self._lock:
            bursts, self._bursts, self._pending = self._bursts, [], False
        for burst in bursts:
            if (listener := self.listeners.get(burst[0].request_id)) is not None:
                listener(burst)


DONE = object()


class Generation:
    """One HTTP request's rows on the engine. Tokens come from the engine thread and are handled on the event
    loop, in order; the engine's result follows its last token through the same queue."""

    def __init__(self, server: "RolloutServer", plan: Plan, request_id: str) -> None:
        self.server, self.plan, self.request_id = server, plan, request_id
        self.arrival = time.monotonic()
        self.rows = [StreamedChoice(server, plan, i) for i in range(len(plan.prompts) * plan.n)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def start(self) -> None:
        loop, relay = asyncio.get_running_loop(), self.server.relay()
        # Tokens as they come only for a reader of them: a stream, or stop strings to find (the engine cannot).
        self.listening = self.plan.stream or bool(self.plan.stops)
        if self.listening:
            relay.listeners[self.request_id] = self._tokens
        try:
            self.future = self.server.engine.submit(self.plan.rows(self.request_id),
                                                    relay.put if self.listening else None)
        except RuntimeError as exc:  # the engine is stopping
            relay.listeners.pop(self.request_id, None)
            raise HttpError(503, f"the rollout engine cannot take requests: {exc}", None, "engine_stopped") from None
        self.future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished, relay))
        self.server.metrics.prompt_tokens.inc(sum(len(p) for p in self.plan.prompts))

    def _finished(self, relay: "TokenRelay") -> None:
        """The engine resolved the request (after its last token): count how its rows ended, whether or not
        anyone still listens (a client that hung up leaves aborted rows)."""
        if self.listening:
            relay.deliver()  # the request's last tokens come before its end
            del relay.listeners[self.request_id]
        m = self.server.metrics
        if self.future.exception() is None:
            for out in self.future.result():
                if out.finish_reason != "error":
                    m.finished.labels("stop" if self.rows[out.row].stopped else out.finish_reason).inc()
        m.e2e.observe(time.monotonic() - self.arrival)
        self.queue.put_nowait(DONE)

    def _tokens(self, events: list[TokenEvent]) -> None:
        """A burst of this request's tokens (one engine step's), on the loop: text and stop strings; a stream gets
        the burst."""
        kept = []
        for event in events:
            row = self.rows[event.row]
            if row.stopped:  # sampled before the engine saw the cancel: not part of the answer
                continue
            row.text.add(event.token_id)
            if row.stopped:
                self.server.engine.cancel(self.request_id, [event.row])
            kept.append(event)
        if self.plan.stream and kept:
            self.queue.put_nowait(kept)

    async def bursts(self) -> AsyncIterator[dict[int, list[TokenEvent]]]:
        """For a stream: the tokens that arrived since the last call, by row, until the request ends."""
        while (item := await self.queue.get()) is not DONE:
            burst: dict[int, list[TokenEvent]] = {}
            while item is not DONE:
                for event in item:
                    burst.setdefault(event.row, []).append(event)
                if self.queue.empty():
                    break
                item = self.queue.get_nowait()
            yield burst
            if item is DONE:
                return

    async def outputs(self) -> list[RowOutput]:
        """Not streamed: wait for the end (no token travels through the queue)."""
        await self.queue.get()
        return self.result()

    def result(self) -> list[RowOutput]:
        self.finished = True
        if (exc := self.future.exception()) is not None:  # no weights yet, or the engine stopped
            raise HttpError(503, f"the rollout engine cannot serve: {exc}", None, "engine_unavailable")
        outputs = sorted(self.future.result(), key=lambda o: o.row)
        failed = [o for o in outputs if o.finish_reason == "error"]
        if failed:
            raise HttpError(500, f"choice {failed[0].row} failed in the engine: {failed[0].error}", None,
                            "row_failed")
        for row, out in zip(self.rows, outputs):
            if not self.listening:  # no token came as it was sampled: the text is made once, here
                for token in out.token_ids:
                    row.text.add(token)
            row.text.finish()
        return outputs

    def cancel(self) -> None:
        if not self.finished:
            self.server.engine.cancel(self.request_id)


@dataclass
class Answer:
    """A row's answer, cut at its stop string if one ended it."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: api.FinishReason
    stop_reason: int | str | None
    routed: object  # numpy ids [prompt + completion - 1, layers, k], until written to the routing store
    versions: list[api.WeightSpan]  # the weights of token_ids' tokens
    routing: RoutingRef | None = None  # where `routed` was written

    @property
    def routing_ref(self) -> dict | None:
        return None if self.routing is None else self.routing.to_json()


def choice_of(row: StreamedChoice, out: RowOutput, stop_token_ids: tuple[int, ...]) -> Answer:
    kept = row.text.kept_tokens if row.stopped else len(out.token_ids)
    ids = out.token_ids[:kept]
    if row.stopped:
        finish, stop_reason = "stop", row.text.stopped_by
    else:
        finish = out.finish_reason
        stop_reason = ids[-1] if finish == "stop" and ids and ids[-1] in stop_token_ids else None
    routed = None if out.routing is None else out.routing[:len(row.prompt) + len(ids) - 1]  # prompt + completion[:-1]
    top = out.top_logprobs[:kept] if out.top_logprobs is not None else None
    versions = [api.WeightSpan(version=s.version, lineage=s.lineage, tokens=s.tokens)
                for s in first_tokens(out.weight_versions, kept)]
    return Answer(out.row, ids, out.logprobs[:kept], top, finish, stop_reason, routed, versions)


class RolloutServer:
    """The HTTP face of one engine: validation, generation on the event loop, responses, weights, health."""

    def __init__(self, run: RunConfig, engine, tokenizer: Tokenizer, *, token: str | None) -> None:
        self.run, self.engine, self.token = run, engine, token
        self.model = ServedModel(run, tokenizer)
        self.metrics = RolloutMetrics(engine.metrics)
        self.routing = RoutingStore.of(run, engine.metrics)
        self.num_experts = run.model.num_experts
        self.created = int(time.time())
        self._relay: TokenRelay | None = None

    def relay(self) -> TokenRelay:
        """The token relay of the running event loop (one per loop; made on the first request)."""
        loop = asyncio.get_running_loop()
        if self._relay is None or self._relay.loop is not loop:
            self._relay = TokenRelay(loop)
        return self._relay

    # ---- weights ---------------------------------------------------------------------------------------------
    def load_version(self, version: int, lineage: int | None = None) -> float:
        """Blocking: fetch and swap in `version` of `lineage` (default: the store's newest lineage); the engine
        swaps between steps."""
        seconds = self.engine.load_version(version if lineage is None else VersionRef(lineage, version))
        self.metrics.lineage.set(self.engine.lineage)
        return seconds

    def health(self) -> tuple[bool, EngineHealth, float]:
        """Alive unless the engine loop has neither stepped nor idled for rollout.hung_after_s."""
        h = self.engine.health()
        silent = time.monotonic() - h.last_step_monotonic
        return silent <= self.run.rollout.hung_after_s, h, silent

    # ---- generation ------------------------------------------------------------------------------------------
    async def generate(self, request: Request, plan: Plan, prefix: str):
        version = self.engine.version
        if version is None:
            raise HttpError(503, "no weights loaded yet; retry once GET /ready answers 200", None, "not_ready")
        gen = Generation(self, plan, f"{prefix}-{uuid.uuid4().hex}")
        gen.start()
        if plan.stream:
            return StreamingResponse(self._stream(gen, version, self.engine.lineage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(_cancel_on_disconnect(request, gen))
        try:
            outputs = await gen.outputs()
        finally:
            watcher.cancel()
        self.metrics.requests.inc()
        return self._respond(gen, outputs, await self._choices(gen, outputs))

    def _head(self, gen: Generation, version: int, lineage: int) -> dict:
        return {"id": gen.request_id, "created": int(time.time()), "model": self.model.name,
                "weight_version": version, "weight_lineage": lineage}

    async def _choices(self, gen: Generation, outputs: list[RowOutput]) -> tuple[list[Answer], dict, api.Usage]:
        choices = [choice_of(row, o, gen.plan.params[0].stop_token_ids) for row, o in zip(gen.rows, outputs)]
        if any(c.routed is not None for c in choices):  # megabytes a choice at RL lengths: off the event loop
            await asyncio.to_thread(self._write_routing, gen.request_id, choices)
        # The oldest weights of any token (a swap in flight changes them under running rows, and a request's rows
        # may even start on different versions): staleness read from the head is never understated.
        lineage, version = min(o.oldest for o in outputs)
        head = self._head(gen, version, lineage)
        prompt = sum(len(p) for p in gen.plan.prompts)
        completion = sum(len(c.token_ids) for c in choices)
        return choices, head, api.Usage(prompt_tokens=prompt, completion_tokens=completion,
                                        total_tokens=prompt + completion)

    def _write_routing(self, request_id: str, choices: list[Answer]) -> None:
        """Each choice's routed experts into the routing store under `<request id>-<choice>` (the request id is
        this server's, unique: a retried or hedged request's other answers never collide with this one's)."""
        for c in choices:
            if c.routed is not None:
                c.routing, c.routed = self.routing.write(f"{request_id}-{c.index}", c.routed, self.num_experts), None

    def _respond(self, gen: Generation, outputs: list[RowOutput], answered: tuple[list[Answer], dict, api.Usage]):
        plan = gen.plan
        choices, head, usage = answered
        if plan.kind == "completion":
            out = []
            for row, c, o in zip(gen.rows, choices, outputs):
                echo = self._echo(gen, row)
                logprobs = None
                if plan.logprobs is not None:
                    logprobs = self._completion_logprobs(gen, c.token_ids, c.logprobs, c.top_logprobs, len(echo))
                    if plan.echo:  # the prompt's tokens first, as OpenAI's echo lists them (the first one None)
                        logprobs = self._joined(self._completion_logprobs(
                            gen, list(row.prompt), o.prompt_logprobs, o.prompt_top_logprobs, 0), logprobs)
                out.append(api.CompletionChoice(
                    index=c.index, text=echo + row.text.text, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, token_ids=c.token_ids, routing_ref=c.routing_ref,
                    weight_versions=c.versions,
                    prompt_token_ids=list(row.prompt) if plan.return_token_ids else None, logprobs=logprobs))
            return api.CompletionResponse(**head, choices=out, usage=usage)
        out = [api.ChatChoice(
            index=c.index, message=api.AssistantMessage(content=row.text.text), finish_reason=c.finish_reason,
            stop_reason=c.stop_reason, token_ids=c.token_ids, routing_ref=c.routing_ref, weight_versions=c.versions,
            prompt_token_ids=list(row.prompt) if plan.return_token_ids else None,
            logprobs=self._chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs)
            if plan.logprobs is not None else None)
            for row, c in zip(gen.rows, choices)]
        return api.ChatCompletionResponse(**head, choices=out, usage=usage)

    async def _stream(self, gen: Generation, version: int, lineage: int) -> AsyncIterator[str]:
        """Server-sent events: a chunk per sampled token (its text once it is whole and cannot begin a stop
        string), then per choice a last chunk with its finish reason (and routed experts), usage if asked."""
        plan = gen.plan
        try:
            head = self._head(gen, version, lineage)
            if plan.kind == "chat":
                for i in range(len(gen.rows)):
                    yield _sse(api.ChatCompletionChunk(**head, choices=[api.ChatChunkChoice(
                        index=i, delta=api.Delta(role="assistant", content=""))]))
            elif plan.echo:
                for i, row in enumerate(gen.rows):
                    yield _sse(api.CompletionResponse(**head, choices=[api.CompletionChoice(
                        index=i, text=self._echo(gen, row), finish_reason=None)]))
            # A chunk per row and burst, all of a burst in one write; each chunk is the request's envelope (rendered
            # once) around that row's choice, so a token costs one small model's checks and JSON.
            before = _envelope(api.ChatCompletionChunk if plan.kind == "chat" else api.CompletionResponse, head)
            async for burst in gen.bursts():
                yield "".join(f"{before}{self._token_choice(gen, index, events).model_dump_json()}]}}\n\n"
                              for index, events in burst.items())
            choices, head, usage = await self._choices(gen, gen.result())
            for row, c in zip(gen.rows, choices):
                text = row.text.take(final=True)
                if plan.kind == "chat":
                    chunk = api.ChatCompletionChunk(**head, choices=[api.ChatChunkChoice(
                        index=c.index, delta=api.Delta(content=text), finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason, routing_ref=c.routing_ref, weight_versions=c.versions)])
                else:
                    chunk = api.CompletionResponse(**head, choices=[api.CompletionChoice(
                        index=c.index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                        routing_ref=c.routing_ref, weight_versions=c.versions)])
                yield _sse(chunk)
            if plan.include_usage:
                cls = api.ChatCompletionChunk if plan.kind == "chat" else api.CompletionResponse
                yield _sse(cls(**head, choices=[], usage=usage))
            self.metrics.requests.inc()
        except HttpError as err:  # the status line is sent already: the error travels as an event
            self.metrics.errors.labels(str(err.status)).inc()
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            gen.cancel()  # a client gone mid-stream: its rows stop (a no-op once they finished)
        yield "data: [DONE]\n\n"

    def _token_choice(self, gen: Generation, index: int, events: list[TokenEvent]):
        """Row `index`'s choice in a stream chunk: the text its new tokens released, and their ids and logprobs."""
        plan, row = gen.plan, gen.rows[index]
        text = row.text.take()
        ids = [e.token_id for e in events]
        token_ids = ids if plan.return_token_ids else None
        logprobs = [e.logprob for e in events]
        tops = None if events[0].top_logprobs is None else [e.top_logprobs for e in events]
        if plan.kind == "chat":
            chat_logprobs = self._chat_logprobs(ids, logprobs, tops) if plan.logprobs is not None else None
            return api.ChatChunkChoice(index=index, delta=api.Delta(content=text), logprobs=chat_logprobs,
                                       token_ids=token_ids)
        completion_logprobs = None
        if plan.logprobs is not None:
            completion_logprobs = self._completion_logprobs(gen, ids, logprobs, tops, row.offset)
            row.offset += sum(len(t) for t in completion_logprobs.tokens)
        return api.CompletionChoice(index=index, text=text, finish_reason=None, logprobs=completion_logprobs,
                                    token_ids=token_ids)

    def _echo(self, gen: Generation, row: StreamedChoice) -> str:
        return self.model.tokenizer.decode(list(row.prompt)) if gen.plan.echo else ""

    def _completion_logprobs(self, gen: Generation, ids: list[int], logprobs: list[float | None],
                             tops: list[list[tuple[int, float]] | None] | None, start: int) -> api.CompletionLogprobs:
        tokens = [self.model.token_text(t) for t in ids]
        offsets = list(accumulate((len(t) for t in tokens), initial=start))[:len(tokens)]
        top = None
        if gen.plan.logprobs and tops is not None:
            top = [None if alts is None else {self.model.token_text(t): lp for t, lp in alts} for alts in tops]
        return api.CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=top, text_offset=offsets)

    @staticmethod
    def _joined(first: api.CompletionLogprobs, then: api.CompletionLogprobs) -> api.CompletionLogprobs:
        top = None if first.top_logprobs is None or then.top_logprobs is None else first.top_logprobs + then.top_logprobs
        return api.CompletionLogprobs(tokens=first.tokens + then.tokens, top_logprobs=top,
                                      token_logprobs=first.token_logprobs + then.token_logprobs,
                                      text_offset=first.text_offset + then.text_offset)

    def _chat_logprobs(self, ids: list[int], logprobs: list[float],
                       tops: list[list[tuple[int, float]]] | None) -> api.ChatLogprobs:
        def entry(token: int, logprob: float) -> dict:
            text = self.model.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return api.ChatLogprobs(content=[
            api.TokenLogprob(**entry(t, lp), top_logprobs=[api.TopLogprob(**entry(a, alp)) for a, alp in alts])
            for t, lp, alts in zip(ids, logprobs, tops or [[] for _ in ids])])


def _envelope(cls, head: dict) -> str:
    """`data: ` and a chunk of `cls` with `head`'s fields up to its choices' opening bracket: a choice's JSON and
    `]}` complete it (the models list `choices` last)."""
    empty = cls(**head, choices=[]).model_dump_json()
    if not empty.endswith('"choices":[]}'):
        raise RuntimeError(f"{cls.__name__} no longer serializes its choices last: {empty}")
    return f"data: {empty[:-2]}"


def _sse(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def _cancel_on_disconnect(request: Request, gen: Generation) -> None:
    """The body is read: the next ASGI message is the client going away (or the answer being sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gen.cancel()


class CountErrors:
    """Counts answers of status >= 400 by status (plain ASGI: it only watches the status line go by)."""

    def __init__(self, app, counter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send) -> None:
        async def watch(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.counter.labels(str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, watch if scope["type"] == "http" else send)


ERRORS = {status: {"model": api.ErrorResponse} for status in (400, 401, 404, 409, 413, 500, 503)}


def make_app(server: RolloutServer) -> FastAPI:
    app = json_api("moe-rl-eks rollout server", __doc__.split("\n\n")[0])

    app.add_middleware(CountErrors, counter=server.metrics.errors)

    def warn_unknown(path: str, body: api.Request) -> None:
        if unknown := body.unknown_fields():
            log.warning("%s: ignoring unknown fields %s", path, ", ".join(unknown))

    @app.post("/v1/completions", response_model=api.CompletionResponse, responses=ERRORS)
    async def completions(body: api.CompletionRequest, request: Request):
        warn_unknown("/v1/completions", body)
        return await server.generate(request, server.model.completion_plan(body), "cmpl")

    @app.post("/v1/chat/completions", response_model=api.ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: api.ChatCompletionRequest, request: Request):
        warn_unknown("/v1/chat/completions", body)
        return await server.generate(request, server.model.chat_plan(body), "chatcmpl")

    @app.get("/v1/models", response_model=api.ModelList)
    async def models() -> api.ModelList:
        version = server.engine.version
        return api.ModelList(data=[api.ModelCard(
            id=server.model.name, created=server.created, max_model_len=server.model.context,
            weight_version=version, weight_lineage=server.engine.lineage)])

    @app.get("/health", response_model=api.Health, responses={503: {"model": api.Health}})
    async def health():
        alive, h, silent = server.health()
        body = api.Health(status="ok" if alive else "hung", weight_version=h.version, running=h.running_rows,
                          waiting=h.waiting_rows, seconds_since_step=silent, row_tokens_per_s=h.row_tokens_per_s)
        return JSONResponse(body.model_dump(), status_code=200 if alive else 503)

    @app.get("/ready", response_model=api.Readiness, responses={503: {"model": api.Readiness}})
    async def ready():
        version = server.engine.version
        body = api.Readiness(ready=version is not None, weight_version=version, weight_lineage=server.engine.lineage,
                             row_tokens_per_s=server.engine.health().row_tokens_per_s)
        return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        h = server.engine.health()
        server.metrics.running.set(h.running_rows)
        server.metrics.waiting.set(h.waiting_rows)
        return PlainTextResponse(server.metrics.registry.exposition(), media_type="text/plain; version=0.0.4")

    def bearer(authorization: str | None = Header(None)) -> None:
        if not server.token or not secrets.compare_digest(authorization or "", f"Bearer {server.token}"):
            raise HttpError(401, "weight loading needs 'Authorization: Bearer <token>'", None, "unauthorized")

    @app.post("/v1/weights/load", response_model=api.WeightLoadResponse, responses=ERRORS,
              dependencies=[Depends(bearer)])
    async def load_weights(body: api.WeightLoadRequest) -> api.WeightLoadResponse:
        try:
            seconds = await asyncio.to_thread(server.load_version, body.version, body.lineage)
        except Exception as exc:  # noqa: BLE001 -- a bad version must not take the server down
            raise HttpError(409, f"version {body.version} could not be loaded: {exc}", "version",
                            "version_unavailable") from None
        return api.WeightLoadResponse(weight_version=server.engine.version, weight_lineage=server.engine.lineage,
                                      load_seconds=seconds)

    return app
