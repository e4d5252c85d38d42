"""`moerl eval` and the in-process evaluation of checkpoint directories: a policy sampled in this process by the
rollout engine's decoder, scored by the orchestrator's evaluation (workloads/orchestrator/evaluation.py)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_rl_eks.workloads.orchestrator.evaluation import (EVAL_STREAM, PROMPTS_PER_CALL, Complete, EvalParams,
                                                          EvalSample, completion_text, evaluate, params_for,
                                                          prompt_mean_rewards, record, score_prompts, summarise)
from moe_rl_eks.workloads.rl.data import Prompt
from moe_rl_eks.workloads.rl.rewards import RewardScorer


class CheckpointEvaluator:
    """The run's evaluation (rl.evaluation) of the weights of checkpoint directories (published versions),
    sampled in this process: the local run's evaluation of its initial, post-warm-up and final weights, bench-rl's
    evaluation curve. The tokenizer, the evaluation prompts (a dataset is read once) and one set of reward workers
    serve every checkpoint; use it as a context manager (closing stops the reward workers)."""

    def __init__(self, run) -> None:
        from moe_rl_eks.workloads.rl.data import evaluation_prompts
        from moe_rl_eks.workloads.rl.tokenizer import load_tokenizer

        self.run = run
        self.tokenizer = load_tokenizer(run.rl.sampling.tokenizer)
        self.prompts = evaluation_prompts(run, self.tokenizer)
        self.scorer = RewardScorer(run.rl.reward)

    def __call__(self, directory: str | Path) -> dict[str, float]:
        return self.scored(directory)[0]

    def scored(self, directory: str | Path) -> tuple[dict[str, float], list[float]]:
        """The metrics of the weights in `directory` and each evaluation prompt's mean reward (in prompt order, the
        same for every directory: paired). On a GPU when this process has one, all prompts in one batch."""
        import torch

        from moe_rl_eks.workloads.model.checkpoint import load_model

        device = "cuda" if torch.cuda.is_available() else "cpu"
        complete = model_completer(load_model(directory, device=device).eval(), self.tokenizer)
        per_call = len(self.prompts) if device == "cuda" else PROMPTS_PER_CALL
        per_prompt = score_prompts(self.prompts, complete, self.scorer, params_for(self.run),
                                   prompts_per_call=per_call)
        metrics = summarise(per_prompt, params_for(self.run).n, self.run.rl.reward.pass_threshold)
        return metrics, prompt_mean_rewards(per_prompt)

    def __enter__(self) -> "CheckpointEvaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.scorer.close()


def model_completer(model, tokenizer) -> Complete:
    """Samples from a MoETransformer in this process (the rollout engine's decoder), stopping on every EOS id."""
    def complete(prompts: list[Prompt], params: EvalParams) -> list[list[EvalSample]]:
        import torch

        from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
        from moe_rl_eks.workloads.rollout.decoder import decode_all
        from moe_rl_eks.workloads.rl.protocol import derive_seed

        requests = [RowRequest(p.prompt_ids, SamplingParams(params.max_tokens, params.temperature, params.top_p,
                                                            seed=derive_seed(params.seed, EVAL_STREAM, p.index)),
                               str(p.index), j)
                    for p in prompts for j in range(params.n)]
        with torch.no_grad():
            outs = decode_all(model, requests, tokenizer.eos_ids)
        out = [EvalSample(completion_text(tokenizer, o.token_ids, o.finish_reason == "stop"), len(o.token_ids),
                      o.finish_reason == "stop") for o in outs]
        return [out[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]
    return complete


def main(argv: list[str]) -> int:
    """`moerl eval --model DIR --data FILE`: evaluate a Hugging Face checkpoint outside a run."""
    parser = argparse.ArgumentParser(prog="moerl eval", description=main.__doc__.split(": ", 1)[1])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory (weights, config.json, "
                        "tokenizer files, generation_config.json)")
    parser.add_argument("--data", help="evaluation data in verl's layout: a Parquet/JSONL file, a directory, a glob "
                        "or an S3 prefix (path or s3://); default: the --run's evaluation prompts")
    parser.add_argument("--run", help="a run file whose rl.data/rl.reward/rl.evaluation settings to use")
    parser.add_argument("--reward", default=None, help="arithmetic, math or package.module:function (default: the "
                        "run's, else math)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    parser.add_argument("--prompts", type=int, default=None, help="evaluate at most this many prompts")
    parser.add_argument("-n", "--samples", type=int, default=None, help="samples per prompt (k of pass@k)")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--chat-template-kwargs", default="{}", help='JSON, e.g. {"enable_thinking": false}')
    parser.add_argument("--s3-endpoint-url", default=None)
    parser.add_argument("--out", help="append the metrics to OUT/eval.jsonl")
    args = parser.parse_args(argv)
    run = eval_run(args)
    from moe_rl_eks.workloads.model.checkpoint import load_model
    from moe_rl_eks.workloads.rl.data import evaluation_prompts
    from moe_rl_eks.workloads.rl.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or run.rl.sampling.tokenizer)
    model = load_model(args.model).eval()
    scorer = RewardScorer(run.rl.reward)
    try:
        metrics = evaluate(evaluation_prompts(run, tokenizer), model_completer(model, tokenizer), scorer,
                           params_for(run), pass_threshold=run.rl.reward.pass_threshold)
    finally:
        scorer.close()
    if args.out:
        record(args.out, 0, metrics)
    json.dump(metrics, sys.stdout, indent=1)
    print()
    return 0


def eval_run(args):
    """A RunConfig for `moerl eval`: the --run file (or one derived from --model's directory) with the flags
    applied, parsed and validated like any run file."""
    import yaml

    from moe_rl_eks.core.run import RunConfig
    from moe_rl_eks.core.schema import parse

    from moe_rl_eks.workloads.rl.model_dir import model_run_data

    if args.run:
        data = yaml.safe_load(Path(args.run).read_text())
    else:
        data = model_run_data(args.model, max_new_tokens=args.max_tokens)
    rl = data.setdefault("rl", {})
    rl.setdefault("sampling", {})["tokenizer"] = args.tokenizer or args.model
    if args.data:
        rl["data"] = {**rl.get("data", {}), "train": args.data, "eval": args.data,
                      "chat_template_kwargs": json.loads(args.chat_template_kwargs),
                      "s3_endpoint_url": args.s3_endpoint_url}
    if args.reward or not args.run:
        rl.setdefault("reward", {})["function"] = args.reward or "math"
    evaluation = rl.setdefault("evaluation", {})
    for key, value in (("prompts", args.prompts), ("samples_per_prompt", args.samples),
                       ("max_tokens", args.max_tokens), ("temperature", args.temperature)):
        if value is not None:
            evaluation[key] = value
    return parse(RunConfig, data, source=args.run or f"moerl eval --model {args.model}")
