"""`moerl bench-rollout`: the rollout engine's decode throughput on one GPU against transformers' generate() and
the weight-read roofline, plus the logprob mismatch between the engine and the trainer's forward.

Model: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 128 experts top-8, expert width 768, 32/4 heads of 128,
vocabulary 151,936), bf16, random weights. Rows have distinct random prompts and sample (temperature 1, no stop
token) exactly `--new-tokens` tokens each. tokens/s = rows x new tokens / wall time from submission to the last
token (prefill included); the decode rate (steps after the prefill) is reported too. Roofline: the bytes one decode
step must read (every dense weight, plus the experts a batch of that size touches in expectation under uniform
routing) over the copy bandwidth measured in the same run (bytes read + written by a device-to-device copy).

Needs CUDA (`--tiny` runs a small model on the CPU, to test this script). On the GPU machine run it as a module:
`python3 -m moe_rl_eks.tools.bench.rollout --json out.json`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import random
import statistics
import time

import torch

from moe_rl_eks.core.models import known_model
from moe_rl_eks.core.run import ModelConfig

from moe_rl_eks.workloads.model import MoETransformer
from moe_rl_eks.workloads.model.backends import get_compute
from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
from moe_rl_eks.workloads.rollout.decoder import Decoder

# The benchmarks' rows are short (prompt + 256 new tokens): a 4,096-position context keeps their block tables and
# KV reservations to what they use (serve-rollout --model serves a checkpoint's own 40,960).
QWEN3_30B_A3B = dataclasses.replace(known_model("qwen3-30b-a3b"), max_position_embeddings=4096)
TINY = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, moe_intermediate_size=64, num_experts=8,
                   num_experts_per_tok=2, max_position_embeddings=512, dtype="float32")
# The trainer's forward scores a trained model's logits, not a random init's nearly uniform ones: the mismatch
# model's output head is scaled so that a token's logit has a standard deviation of about 3.
MISMATCH_LOGIT_STD = 3.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 4 GiB device-to-device copy (median of 10 after 3 warm-ups)."""
    n = (4 << 30) // 2 if device.type == "cuda" else 1 << 22
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def step_bytes(config: ModelConfig, batch: int) -> float:
    """Weight bytes one decode step of `batch` rows reads: every dense weight (attention, norms, routers, the
    output head) and the experts the batch touches, in expectation under uniform top-k routing."""
    c = config
    attention = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    router = c.num_experts * c.hidden_size
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    touched = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** batch)
    per_layer = attention + router + touched * expert
    return 2 * (c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size)  # bf16


def build_model(config: ModelConfig, device: torch.device, compute: str = "torch") -> MoETransformer:
    """Random weights made on the device itself (a CPU init of 30 B parameters takes minutes)."""
    dtype = getattr(torch, config.dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MoETransformer(config, compute=compute)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def use_compute(model: MoETransformer, name: str) -> None:
    """Point every MoE layer (and its dispatcher) of `model` at the compute backend `name`."""
    compute = get_compute(name)
    model.compute = compute
    for layer in model.model.layers:
        layer.mlp.compute = compute
        layer.mlp.dispatcher.compute = compute


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(vocab) for _ in range(length)) for _ in range(batch)]


def run_engine(model: MoETransformer, batch: int, prompt_tokens: int, new_tokens: int, *, graphs: bool,
               max_seconds: float, lengths: list[int] | None = None, slots: int | None = None,
               kernels: str | None = None, look_ahead: bool = False) -> dict:
    """One batch of distinct prompts through a Decoder sized for it; stops early (and says so) past max_seconds
    of decoding. `lengths`: each row's own new tokens (at most new_tokens; default new_tokens each), `slots`: rows
    decoding at once (default all; the rest wait for a finished row's slot, as in a server), `look_ahead`: the
    decoder's (rollout.async_scheduling)."""
    device = next(model.parameters()).device
    lengths = [new_tokens] * batch if lengths is None else lengths
    slots = batch if slots is None else slots
    build = time.perf_counter()
    decoder = Decoder(model, slots=slots, max_len=prompt_tokens + new_tokens, eos_ids=(), prefill_tokens=8192,
                      cuda_graphs=graphs, buckets=[slots], kernels=kernels, look_ahead=look_ahead)
    sync(device)
    capture_s = time.perf_counter() - build
    rows = [RowRequest(p, SamplingParams(n, seed=i), "bench", i) for i, (p, n) in
            enumerate(zip(prompts(batch, prompt_tokens, model.config.vocab_size, batch + prompt_tokens), lengths))]
    seqs = [decoder.add(r) for r in rows]
    start, started_at = time.perf_counter(), time.time()
    decode_start, steps, all_steps = None, 0, 0
    while decoder.busy:
        decoder.step()
        all_steps += 1
        if decode_start is None and not decoder.scheduler.prefilling and not decoder.waiting:
            sync(device)
            decode_start, tokens_at_decode = time.perf_counter(), sum(len(s.tokens) for s in seqs)
            kv = decoder.stats()  # blocks held once every prompt is in: memory follows the tokens present
            decoder.take_device_seconds()  # the decode steps' device time from here on
            continue
        if decode_start is None:  # rows still wait for slots or prefill: not a decode step of the figures below
            continue
        steps += 1
        if time.perf_counter() - decode_start > max_seconds:
            for s in seqs:
                decoder.cancel(s)
    sync(device)
    end = time.perf_counter()
    generated = sum(len(s.tokens) for s in seqs)
    decode_s = end - decode_start
    device_ms = 1000 * decoder.take_device_seconds() / max(steps, 1)
    out = {"batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "generated": generated,
           "seconds": end - start, "tokens_per_s": generated / (end - start), "prefill_s": decode_start - start,
           "steps": all_steps, "decode_steps": steps, "decode_tokens_per_s": (generated - tokens_at_decode) / decode_s,
           "step_ms": 1000 * decode_s / max(steps, 1), "graph_capture_s": capture_s,
           # of a decode step: the device's span of its forward and sampling, and the host's part the device waits
           # for (scheduling and bookkeeping; ModelRunner's DeviceClock)
           "device_step_ms": device_ms, "host_step_ms": 1000 * decode_s / max(steps, 1) - device_ms,
           "complete": generated == sum(lengths), "cuda_graphs": bool(decoder.runner.graphs),
           "kv_blocks_used_after_prefill": kv["blocks_used"], "kv_blocks_total": kv["blocks_total"],
           "kv_block_size": kv["block_size"], "preemptions": kv["preemptions"], "look_ahead": look_ahead,
           "window": [started_at, time.time()]}  # Unix times of the generation (for GPU samples taken meanwhile)
    del decoder
    return out


def run_transformers(config: ModelConfig, device: torch.device, batches: list[int], prompt_tokens: int,
                     new_tokens: int) -> list[dict]:
    """transformers' Qwen3MoeForCausalLM.generate (sampling, SDPA) on a model of the same shape."""
    import transformers

    from moe_rl_eks.workloads.model.checkpoint import hf_config

    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in hf_config(config).items() if not k.startswith("_")})
    hf._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, config.dtype))
    try:
        with torch.device(device):
            model = transformers.Qwen3MoeForCausalLM(hf).eval()
    finally:
        torch.set_default_dtype(default)
    results = []
    for batch in batches:
        ids = torch.tensor(prompts(batch, prompt_tokens, config.vocab_size, batch), device=device)
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, do_sample=True)  # warm-up
            sync(device)
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=True, pad_token_id=0)
            sync(device)
        seconds = time.perf_counter() - start
        generated = (out.shape[1] - prompt_tokens) * batch
        results.append({"batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                        "generated": generated, "seconds": seconds, "tokens_per_s": generated / seconds})
    del model
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return results


def logprob_mismatch(config: ModelConfig, device: torch.device, layers: int, rows: int, prompt_tokens: int,
                     new_tokens: int) -> dict:
    """The engine's logprobs (processed, temperature 1 = the trainer's distribution) against the trainer's forward
    of the same sequences with the same weights, at `layers` layers."""
    config = dataclasses.replace(config, num_hidden_layers=layers)
    torch.manual_seed(0)
    model = build_model(config, device)
    with torch.no_grad():
        probe = model.model.norm(model.model.embed_tokens.weight[:256]) @ model.lm_head.weight.t()
        model.lm_head.weight.mul_(MISMATCH_LOGIT_STD / probe.float().std())
    decoder = Decoder(model, slots=rows, max_len=prompt_tokens + new_tokens, eos_ids=(), buckets=[rows])
    seqs = [decoder.add(RowRequest(p, SamplingParams(new_tokens, seed=i), "mismatch", i))
            for i, p in enumerate(prompts(rows, prompt_tokens, config.vocab_size, 7))]
    while decoder.busy:
        decoder.step()
    del decoder
    diffs = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([list(s.prompt) + s.tokens], device=device)
            logp = torch.log_softmax(model(ids).logits[0, prompt_tokens - 1:-1].float(), -1)
            trainer = logp.gather(-1, torch.tensor(s.tokens, device=device)[:, None])[:, 0]
            diffs.append(trainer - torch.tensor(s.logprobs, device=device, dtype=torch.float32))
    d = torch.cat(diffs)
    k3 = torch.exp(d) - 1 - d  # KL(rollout || trainer) estimated on the rollout's samples
    del model
    gc.collect()
    return {"layers": layers, "rows": rows, "tokens": d.numel(), "max_abs": d.abs().max().item(),
            "mean_abs": d.abs().mean().item(), "bitwise_equal": (d == 0).float().mean().item(),
            "mean_k3": k3.mean().item()}


def profile_steps(model: MoETransformer, batch: int, prompt_tokens: int, steps: int, path: str | None,
                  kernels: str | None = None) -> dict:
    """GPU time of `steps` decode steps by kernel, from torch.profiler (a Chrome trace at `path`); `kernels`: the
    forward's backend, as run_engine's."""
    from torch.profiler import ProfilerActivity, profile

    decoder = Decoder(model, slots=batch, max_len=prompt_tokens + steps + 8, eos_ids=(), buckets=[batch],
                      kernels=kernels)
    for i, p in enumerate(prompts(batch, prompt_tokens, model.config.vocab_size, 3)):
        decoder.add(RowRequest(p, SamplingParams(steps + 4, seed=i), "profile", i))
    while decoder.scheduler.prefilling or decoder.waiting:
        decoder.step()
    decoder.step()
    sync(decoder.runner.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            decoder.step()
        sync(decoder.runner.device)
        wall = time.perf_counter() - start
    if path:
        prof.export_chrome_trace(path)
    by_kernel: dict[str, float] = {}
    count = 0
    for e in prof.events():
        if e.device_type.name == "CUDA":
            by_kernel[e.name[:60]] = by_kernel.get(e.name[:60], 0.0) + e.device_time_total / 1000 / steps
            count += 1
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:25]
    del decoder
    return {"batch": batch, "wall_ms_per_step": 1000 * wall / steps, "gpu_ms_per_step": sum(by_kernel.values()),
            "kernels_per_step": count / steps, "top_kernels_ms": top}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moerl bench-rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--compute", nargs="+", default=["torch", "triton"], choices=["torch", "triton", "exact"],
                        help="compute backends to measure in turn; exact = numerics: exact (the batch-invariant "
                        "kernels in the MoE layers and the paged forward), the exact column beside triton's")
    parser.add_argument("--layers", type=int, default=QWEN3_30B_A3B.num_hidden_layers)
    parser.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    parser.add_argument("--max-seconds", type=float, default=30.0,
                        help="stop a configuration's decoding after this long (its row says partial)")
    parser.add_argument("--kv-budget-gib", type=float, default=48.0,
                        help="skip configurations whose KV cache would exceed this")
    parser.add_argument("--transformers-batches", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--transformers-new-tokens", type=int, default=32)
    parser.add_argument("--mismatch-layers", type=int, default=8, help="0 skips the logprob mismatch")
    parser.add_argument("--profile", type=int, nargs="*", default=[], metavar="BATCH",
                        help="profile a few decode steps at these batch sizes")
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--tiny", action="store_true", help="a small model on the CPU (tests this script)")
    parser.add_argument("--json", default=None, help="write every result here")
    parser.add_argument("--gpus-per-server", type=int, nargs="+", default=None, metavar="N",
                        help="instead: a rollout server's engine sharded over N ranks (one per GPU, NCCL; gloo with "
                             "--tiny) as serve-rollout runs it, at each N; throughput per --batches (see run_sharded)")
    args = parser.parse_args(argv)
    if args.gpus_per_server:
        return run_sharded(args)
    device = torch.device("cpu" if args.tiny else "cuda")

    def save() -> None:  # after every measurement: a run cut short by a time limit keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    config = TINY if args.tiny else dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    report: dict = {"model": dataclasses.asdict(config), "device": torch.cuda.get_device_name() if
                    device.type == "cuda" else "cpu", "torch": torch.__version__, "args": vars(args),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    bandwidth = copy_bandwidth(device)
    report["copy_bandwidth_bytes_per_s"] = bandwidth
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)

    if args.transformers_batches and not args.tiny:
        report["transformers"] = run_transformers(config, device, args.transformers_batches, 128,
                                                  args.transformers_new_tokens)
        for r in report["transformers"]:
            print(f"transformers batch {r['batch']}: {r['tokens_per_s']:.1f} tok/s", flush=True)

    torch.manual_seed(0)
    model = build_model(config, device)
    report["engine"] = []
    kv_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * (
        2 if config.dtype == "bfloat16" else 4)
    for compute in args.compute:
        use_compute(model, compute)
        kernels = "exact" if compute == "exact" else None  # the forward's backend beside the MoE compute
        for prompt_tokens in args.prompt_tokens:
            for batch in args.batches:
                kv_gib = batch * (prompt_tokens + args.new_tokens) * kv_per_position / 2 ** 30
                row = {"compute": compute, "batch": batch, "prompt_tokens": prompt_tokens}
                if kv_gib > args.kv_budget_gib:
                    row["skipped"] = f"KV cache {kv_gib:.0f} GiB > --kv-budget-gib {args.kv_budget_gib:.0f}"
                else:
                    try:
                        row.update(run_engine(model, batch, prompt_tokens, args.new_tokens,
                                              graphs=not args.no_graphs, max_seconds=args.max_seconds,
                                              kernels=kernels))
                        roofline = batch * bandwidth / step_bytes(config, batch)
                        row["roofline_tokens_per_s"] = roofline
                        row["roofline_fraction"] = row["decode_tokens_per_s"] / roofline
                    except torch.OutOfMemoryError as exc:
                        row["skipped"] = f"out of memory: {str(exc).splitlines()[0]}"
                    except Exception as exc:  # noqa: BLE001 -- record it, measure the other configurations
                        row["skipped"] = f"failed: {type(exc).__name__}: {exc}"
                    gc.collect()
                    torch.cuda.empty_cache() if device.type == "cuda" else None
                report["engine"].append(row)
                save()
                print(json.dumps(row), flush=True)
        for batch in args.profile:
            path = f"{args.trace_dir}/trace-{compute}-{batch}.json" if args.trace_dir else None
            prof = profile_steps(model, batch, 128, 8, path, kernels)
            report.setdefault("profile", []).append({"compute": compute, **prof})
            print(json.dumps({"compute": compute, **{k: v for k, v in prof.items() if k != "top_kernels_ms"}}))
            for name, ms in prof["top_kernels_ms"][:12]:
                print(f"   {ms:8.3f} ms  {name}")
    del model
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    if args.mismatch_layers:
        layers = min(args.mismatch_layers, config.num_hidden_layers)
        report["mismatch"] = logprob_mismatch(config, device, layers, 8 if args.tiny else 64, 128,
                                              16 if args.tiny else 256)
        print(json.dumps(report["mismatch"]), flush=True)
    save()
    print_table(report)
    return 0


def run_sharded(args: argparse.Namespace) -> int:
    """The rollout server's engine (RolloutEngine over a Replica) at each --gpus-per-server N: N processes as
    serve-rollout's torchrun starts them (rank 0 drives the engine, the others follow; each holds E / N experts,
    all-to-all over NCCL, one rank per GPU; N = 1 is the one-GPU server), computing with the last --compute
    backend (torch with --tiny). Per batch: one request's rows of distinct
    random prompts, --new-tokens each (EOS ids are the built-in tokenizer's, so a row may stop early), timed from
    submit to the last row's end (prefill included), after one warm-up batch."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    config = TINY if args.tiny else dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    report: dict = {"model": dataclasses.asdict(config), "torch": torch.__version__, "args": vars(args),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "sharded": []}
    for n in args.gpus_per_server:
        if not args.tiny and torch.cuda.device_count() < n:
            row = {"gpus_per_server": n, "skipped": f"needs {n} GPUs, this machine has {torch.cuda.device_count()}"}
        elif config.num_experts % n:
            row = {"gpus_per_server": n, "skipped": f"{n} ranks do not divide {config.num_experts} experts"}
        else:
            with tempfile.TemporaryDirectory() as tmp:
                port = 29500 + os.getpid() % 1000 + n
                mp.start_processes(_sharded_rank, args=(n, args, config, tmp, port), nprocs=n, join=True,
                                   start_method="spawn")
                with open(os.path.join(tmp, "rows.json")) as f:
                    row = {"gpus_per_server": n, "rows": json.load(f)}
        report["sharded"].append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    print(f"{'GPUs':>4} {'batch':>5} {'prompt':>6} {'generated':>9} {'seconds':>8} {'tokens/s':>9}")
    for entry in report["sharded"]:
        for r in entry.get("rows", []):
            print(f"{entry['gpus_per_server']:>4} {r['batch']:>5} {r['prompt_tokens']:>6} {r['generated']:>9} "
                  f"{r['seconds']:>8.2f} {r['tokens_per_s']:>9.1f}")
        if "skipped" in entry:
            print(f"{entry['gpus_per_server']:>4} not run: {entry['skipped']}")
    return 0


def _sharded_rank(rank: int, world: int, args: argparse.Namespace, config: ModelConfig, tmp: str, port: int) -> None:
    try:
        _serve_sharded(rank, world, args, config, tmp, port)
    finally:
        # a rank that exits with its process group's threads running can abort at exit (SIGABRT, "terminate
        # called without an active exception": seen once in make test)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _serve_sharded(rank: int, world: int, args: argparse.Namespace, config: ModelConfig, tmp: str, port: int
                   ) -> None:
    """One rank of run_sharded's server: rank 0 drives the engine and writes the rows, the others follow."""
    import os
    from pathlib import Path

    from moe_rl_eks.core.rl_config import RLConfig, SamplingConfig, WeightStoreConfig
    from moe_rl_eks.core.run import RolloutConfig, RunConfig

    from moe_rl_eks.workloads.model.checkpoint import save_hf
    from moe_rl_eks.workloads.rollout.engine import RolloutEngine
    from moe_rl_eks.workloads.rollout.replica import Replica, follow
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer
    from moe_rl_eks.workloads.rl.weights import DirectoryStore

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1 if args.tiny else 4)
    prompt_tokens = max(args.prompt_tokens)
    run = RunConfig(name="bench-sharded", model=config, moe_compute="torch" if args.tiny else args.compute[-1],
                    rollout=RolloutConfig(gpus_per_server=world, max_batch_size=max(args.batches),
                                          max_new_tokens=args.new_tokens),
                    rl=RLConfig(sampling=SamplingConfig(max_tokens=args.new_tokens, max_prompt_tokens=prompt_tokens),
                                weights=WeightStoreConfig(kind="local", path=f"{tmp}/weights")))
    replica = Replica.sharded(run) if world > 1 else Replica(run)
    if replica.rank > 0:
        follow(replica)
        return
    torch.manual_seed(0)
    staging = Path(tmp) / "staging"
    with replica.device:  # random weights made on the GPU where there is one: much faster than on the host
        save_hf(MoETransformer(config).state_dict(), config, staging)
    if replica.device.type == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its KV cache to what the served weights leave free
    store = DirectoryStore(Path(tmp) / "weights")
    store.publish(0, staging)
    engine = RolloutEngine(run, store, Path(tmp) / "cache", CharTokenizer(), replica)
    try:
        engine.load_version(0)
        rows = []
        for i, batch in enumerate([min(args.batches), *args.batches]):  # the first is a warm-up
            requests = [RowRequest(p, SamplingParams(args.new_tokens, seed=j), f"b{i}", j)
                        for j, p in enumerate(prompts(batch, prompt_tokens, config.vocab_size, i))]
            start = time.perf_counter()
            outputs = engine.submit(requests).result()
            seconds = time.perf_counter() - start
            generated = sum(len(o.token_ids) for o in outputs)
            if i:
                rows.append({"batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": args.new_tokens,
                             "generated": generated, "seconds": seconds, "tokens_per_s": generated / seconds,
                             "errors": sorted({o.error for o in outputs if o.error})})
    finally:
        engine.stop()  # stops the other ranks too
    with open(os.path.join(tmp, "rows.json"), "w") as f:
        json.dump(rows, f)


def print_table(report: dict) -> None:
    print(f"\n{report['device']}, torch {report['torch']}, copy bandwidth "
          f"{report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; tokens/s = rows x new tokens / wall time "
          "(prefill included); decode = steps after the prefill; % = decode rate / weight-read roofline")
    print("| compute | batch | prompt | tokens/s | decode tokens/s | ms/step | roofline tokens/s | % of roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["engine"]:
        if "skipped" in r:
            print(f"| {r['compute']} | {r['batch']} | {r['prompt_tokens']} | skipped: {r['skipped']} | | | | |")
            continue
        partial = "" if r["complete"] else f" (partial: {r['generated']} tokens)"
        print(f"| {r['compute']} | {r['batch']} | {r['prompt_tokens']} | {r['tokens_per_s']:,.0f}{partial} | "
              f"{r['decode_tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {r['roofline_tokens_per_s']:,.0f} | "
              f"{100 * r['roofline_fraction']:.0f} % |")
    for r in report.get("transformers", []):
        print(f"| transformers generate | {r['batch']} | {r['prompt_tokens']} | {r['tokens_per_s']:,.1f} "
              f"({r['new_tokens']} new tokens) | | | | |")
    m = report.get("mismatch")
    if m:
        print(f"\nlogprob mismatch, engine vs trainer forward ({m['layers']} layers, {m['tokens']} tokens): max "
              f"|d log p| {m['max_abs']:.3g}, mean {m['mean_abs']:.3g}, bitwise equal {100 * m['bitwise_equal']:.2f} "
              f"%, mean K3 {m['mean_k3']:.3g}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
