"""`moerl bench-generation`: three costs of the rollout engine's batched decoding, each in a table.

- Prefill: the same rows decode the same number of tokens; only the prompts differ: one prompt for the whole
  group (GRPO's n samples: prefilled once) or a distinct prompt per row (prefilled n times).
- Long tail: a batch whose rows all run to the longest length against one where most rows stop early (as rows
  that reach end-of-sequence do); the second should cost in proportion to the tokens it generates."""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from moe_rl_eks.core.run import ModelConfig

from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
from moe_rl_eks.workloads.rollout.decoder import Decoder, decode_all

# A small MoE that makes the prefill cost visible on a CPU in seconds (Qwen3-MoE-shaped, not sized).
MODEL = ModelConfig(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=32, moe_intermediate_size=256, num_experts=16,
                    num_experts_per_tok=4, max_position_embeddings=1024, dtype="float32")


def rows_for(prompt_tokens: int, lengths: list[int], shared: bool, rng: random.Random) -> list[RowRequest]:
    """One row per entry of `lengths` (its new tokens), all of one prompt or each of its own."""
    def prompt():
        return tuple(rng.randrange(3, 2048) for _ in range(prompt_tokens))  # within every --vocab

    one = prompt()
    # eos id 0 never comes up (vocabulary from 3), so every row decodes exactly its length
    return [RowRequest(one if shared else prompt(), SamplingParams(n, seed=seed), str(seed), 0)
            for seed, n in enumerate(lengths)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moerl bench-generation", description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=16, help="rows per prompt group (GRPO's n)")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=MODEL.vocab_size,
                        help="vocabulary size (151936 is Qwen3's: sampling's share of the cost grows with it)")
    parser.add_argument("--tail-tokens", type=int, nargs=2, default=[64, 8], metavar=("LONG", "SHORT"),
                        help="long tail: one row decodes LONG tokens, the others SHORT")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = dataclasses.replace(MODEL, vocab_size=args.vocab)
    model = MoETransformer(config).eval()
    print(f"model: {MODEL.num_hidden_layers} layers, hidden {MODEL.hidden_size}, {MODEL.num_experts} experts top-"
          f"{MODEL.num_experts_per_tok}, vocabulary {args.vocab}, float32, 1 CPU thread; {args.group} rows, {args.new_tokens} new tokens each; "
          f"median of {args.repeats}")
    print("| prompt tokens | prompts | seconds | rows x new tokens / s | speed-up |")
    print("|---|---|---|---|---|")
    for prompt_tokens in args.prompt_tokens:
        times = {}
        for shared in (False, True):
            rng = random.Random(prompt_tokens)
            times[shared] = statistics.median(
                _timed(model, rows_for(prompt_tokens, [args.new_tokens] * args.group, shared, rng))
                for _ in range(args.repeats))
        for shared in (False, True):
            label = "1 shared" if shared else f"{args.group} distinct"
            rate = args.group * args.new_tokens / times[shared]
            speedup = f"{times[False] / times[shared]:.2f}x" if shared else "1.00x"
            print(f"| {prompt_tokens} | {label} | {times[shared]:.3f} | {rate:.0f} | {speedup} |")
    long, short = args.tail_tokens
    print(f"\nlong tail: {args.group} rows of one 64-token prompt; median of {args.repeats}")
    print("| rows x new tokens | generated tokens | seconds | generated tokens / s |")
    print("|---|---|---|---|")
    rng = random.Random(1)
    for lengths in ([long] * args.group, [long] + [short] * (args.group - 1)):
        seconds = statistics.median(_timed(model, rows_for(64, lengths, True, rng)) for _ in range(args.repeats))
        label = f"{args.group} x {long}" if len(set(lengths)) == 1 else f"1 x {long} + {args.group - 1} x {short}"
        print(f"| {label} | {sum(lengths)} | {seconds:.3f} | {sum(lengths) / seconds:.0f} |")
    rng = random.Random(2)
    lengths = [long if i % 4 == 0 else short for i in range(4 * args.group)]  # a quarter of the rows run long
    requests = [RowRequest(tuple(rng.randrange(3, 2048) for _ in range(16)), SamplingParams(n, seed=i), "r", i)
                for i, n in enumerate(lengths)]
    print(f"\ncontinuous batching: {len(requests)} rows (16-token prompts; every fourth {long} new tokens, the others "
          f"{short}) through {args.group} slots; median of {args.repeats}")
    print("| batching | decode steps | seconds | generated tokens / s |")
    print("|---|---|---|---|")
    for continuous in (False, True):
        runs = [_through_slots(model, requests, args.group, continuous) for _ in range(args.repeats)]
        seconds = statistics.median(r[1] for r in runs)
        label = "continuous (rows join at every step)" if continuous else f"batch by batch ({args.group} rows each)"
        print(f"| {label} | {runs[0][0]} | {seconds:.3f} | {sum(lengths) / seconds:.0f} |")
    return 0


def _through_slots(model, requests: list[RowRequest], slots: int, continuous: bool) -> tuple[int, float]:
    """(steps, seconds) to decode `requests` through a decoder of `slots` rows; batch by batch = the next batch
    is admitted only once the whole previous one has finished."""
    decoder = Decoder(model, slots=slots, max_len=max(len(r.prompt_ids) + r.params.max_tokens for r in requests),
                      eos_ids=())
    waiting, steps = list(requests), 0
    start = time.perf_counter()
    while waiting or decoder.busy:
        if continuous or not decoder.busy:
            take = len(decoder.scheduler.free) if continuous else slots
            for r in waiting[:take]:
                decoder.add(r)
            del waiting[:take]
        decoder.step()
        steps += 1
    return steps, time.perf_counter() - start


def _timed(model, rows) -> float:
    start = time.perf_counter()
    decode_all(model, rows, eos_ids=[0])
    return time.perf_counter() - start
