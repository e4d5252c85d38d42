"""`moerl orchestrate`: the orchestrator behind its HTTP adapter (FastAPI on uvicorn), for the trainers and
for Prometheus.

  GET  /v1/batch?step=s&committed=c   the batch of step s (200), not ready within the long poll (202, with the
                                      trainer version held: null after a restart, at once), or a step that is
                                      neither batched nor the next one (409)
  POST /v1/version {"version", "lineage"}   the trainer published a version: pushed to every rollout server
  POST /v1/trained {"batches": {step: [request ids]}}   the trainer's record of the batches it trained, after a
                                      409 from an orchestrator behind it (restored from an older state): the steps
                                      it lacks are caught up (200 with the next step to form; a state older than
                                      the record is first replaced by the run's newest checkpoint's), or 409 where
                                      the record does not fit, changing nothing
  GET  /v1/state                      the orchestrator's state (what a trainer checkpoint stores)
  GET  /health, /metrics
"""
from __future__ import annotations

import json
import logging
import os
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from moe_rl_eks.core.cluster import ORCHESTRATOR_PORT
from moe_rl_eks.core.run import RunConfig

from ..rl.algorithms import make_algorithm
from ..rl.protocol import OrchestratorState, PromptRecord, VersionRef
from ..rl.runtime import HttpError, json_api, load, output_dir, run_argparser
from .buffer import MalformedRecord, StepConflict
from .client import HttpRolloutBackend
from .driver import Orchestrator, Settings
from .pool import ServerPool
from .state_file import STATE_FILE, checkpoint_state_path, read_state

log = logging.getLogger(__name__)
BATCH_POLL_S = 10.0


class VersionPost(BaseModel):
    version: int = Field(ge=0, strict=True)
    lineage: int = Field(default=0, ge=0, strict=True)


class TrainedPost(BaseModel):
    batches: dict[int, list[str]] = Field(min_length=1)  # step -> the request ids its batch trained


def make_app(orch: Orchestrator, batch_poll_s: float = BATCH_POLL_S) -> FastAPI:
    """`batch_poll_s`: how long a batch request waits for its batch before answering 202."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await orch.start()
        try:
            yield
        finally:
            await orch.stop()

    # every error OpenAI's shape, as the rollout server's: malformed input a 400 naming the field, never a 5xx
    app = json_api("moerl orchestrator", "Batches for the trainers, their versions pushed to the rollout servers",
                   lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        trainer = orch.buffer.trainer
        return {"status": "ok", "published": trainer.to_json() if trainer else None,
                "servers": {v.url: {"healthy": v.healthy, "holds": v.holds.to_json() if v.holds else None,
                                    "in_flight": v.in_flight} for v in orch.pool.view()}}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(orch.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/state")
    async def state() -> dict:
        return orch.snapshot().to_json()

    @app.get("/v1/batch")
    async def batch(step: int = Query(ge=0), committed: int = Query(default=0, ge=0)) -> Response:
        try:
            found = await orch.batch(step, committed, batch_poll_s)
        except StepConflict as exc:
            raise HttpError(409, str(exc), param="step") from None
        if found is None:
            trainer = orch.buffer.trainer
            return JSONResponse({"ready": False, "step": step, "trainer": trainer.to_json() if trainer else None},
                                status_code=202)
        return JSONResponse(found.to_json())

    @app.post("/v1/version")
    async def version(body: VersionPost) -> dict:
        published = await orch.publish(VersionRef(body.lineage, body.version))
        return {"published": published.to_json() if published else None}

    @app.post("/v1/trained")
    async def trained(body: TrainedPost) -> dict:
        try:
            return {"next_step": await orch.catch_up(body.batches)}
        except MalformedRecord as exc:
            raise HttpError(400, str(exc), param="batches") from None
        except StepConflict as exc:
            raise HttpError(409, str(exc), param="batches") from None

    return app


def reward_scorer(run: RunConfig):
    """The run's RewardScorer as the driver's score_many: (prompt record, text, finished) -> score, or None where
    the reward failed (masked, never faked)."""
    from ..rl.data import Prompt
    from ..rl.rewards import RewardScorer

    scorer = RewardScorer(run.rl.reward)

    def score_many(items: list[tuple[PromptRecord, str, bool]]) -> list[float | None]:
        results = scorer.score_many([(Prompt(p.index, tuple(p.prompt_ids), p.text, p.data_source, p.ground_truth,
                                             p.extra_info), text, finished) for p, text, finished in items])
        return [r.score for r in results]

    return score_many


def build(run: RunConfig, endpoints: list[str], token: str | None, events_path: Path | None = None,
          state: OrchestratorState | None = None, fallback: OrchestratorState | None = None,
          state_path: Path | None = None) -> Orchestrator:
    algorithm = make_algorithm(run.rl)

    def advantages(rewards: list[float]) -> list[float]:
        import torch

        return algorithm.sequence_advantages(torch.tensor([rewards]))[0].tolist()

    from ..rl.data import make_prompt_source
    from .evaluation import PeriodicEvaluator
    from ..rl.tokenizer import load_tokenizer

    pool = ServerPool(endpoints, run.rl.orchestrator.max_inflight_requests)
    tokenizer = load_tokenizer(run.rl.sampling.tokenizer)
    source = make_prompt_source(run, tokenizer)
    return Orchestrator(Settings.of(run), pool, HttpRolloutBackend(token), source, reward_scorer(run),
                        advantages, events_path=events_path, state=state, fallback=fallback, state_path=state_path,
                        checkpoints=output_dir(run) / "checkpoints",
                        evaluator=PeriodicEvaluator(run, output_dir(run), tokenizer))


def resume_state(resume: str | None, out: Path) -> OrchestratorState | None:
    """`--resume`: a path to orchestrator.json, or 'latest' for the one in the run's newest trainer checkpoint
    (None while there is no checkpoint yet: a fresh start)."""
    if resume == "latest":
        newest = checkpoint_state_path(out / "checkpoints")
        resume = str(newest) if newest else None
        log.info("resuming from %s", resume or "nothing: no checkpoint yet")
    if not resume:
        return None
    return OrchestratorState.from_json(json.loads(Path(resume).read_text()), path=f"{resume}")


def main(argv: list[str]) -> int:
    import uvicorn

    parser = run_argparser("orchestrate", "drive rollouts and feed trainers for a run")
    parser.add_argument("--port", type=int, default=ORCHESTRATOR_PORT)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--endpoint", action="append", default=[],
                        help="rollout server base URL (repeatable; default: rl.orchestrator.endpoints)")
    parser.add_argument("--resume", help="orchestrator state: orchestrator.json of a trainer checkpoint, or 'latest' "
                                         "for the run's newest checkpoint (a fresh start when there is none); "
                                         f"with {STATE_FILE} in the run's output (written every step), that one "
                                         "is continued and the checkpoint's taken only if the trainer restarts "
                                         "from its checkpoint; without it (lost), the checkpoint's is caught up to "
                                         "a trainer past it from the trainer's record of its batches (one older "
                                         "than that record is replaced by the run's newest checkpoint's first)")
    args = parser.parse_args(argv)
    run = load(args.run)
    out = output_dir(run)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    own, checkpointed = read_state(state_path), resume_state(args.resume, out)
    if own is not None:
        log.info("continuing from %s", state_path)
    orch = build(run, args.endpoint or list(run.rl.orchestrator.endpoints), os.environ.get(run.rl.weight_token_env),
                 out / "orchestrator-events.jsonl", own or checkpointed, checkpointed if own else None, state_path)
    log.info("orchestrator on %s:%d over %d rollout servers", args.host, args.port, len(orch.pool.urls()))
    uvicorn.run(make_app(orch), host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)
    return 0

