"""`moerl bench-server`: what the HTTP server costs on top of the rollout engine it serves.

The same requests (the orchestrator's: n rows of a distinct random prompt each, seeded, temperature 1, each
token's logprob, the routed experts unless `--no-routing`) are sent at each concurrency three ways, in one run against one engine: straight to `RolloutEngine.submit` from threads (no HTTP), as
`/v1/completions` over HTTP with keep-alive connections (aiohttp, the orchestrator's client, in its own process), and as streamed
`/v1/completions` (server-sent events). tokens/s = completion tokens / wall time of the whole batch of requests
(the median of `--repeats` runs, the ways taking turns); the latency columns are per request. The seeds make every
way generate the same tokens, so the ratio is the server's overhead at that load.

`--model qwen3`: issue 10's benchmark shape, Qwen3-30B-A3B (all 48 layers unless `--layers`), 128-token prompts,
256 new tokens, groups of n = 8 (the orchestrator's request mix), concurrency 64 and 256, as many requests as the
concurrency (every request in flight at once); `--layers 4` is the stress figure, where a step is cheap and the
server's per-token work shows most. `--model tiny` (the default): bench-rollout's small model on the CPU, the worst
case for the server's relative overhead. Weights are random, made on the engine's device (a GPU when there is one)
and installed as version 0 directly: a 61 GB checkpoint's trip through a disk is bench-weights' subject, not this
one's. On the GPU machine run it as a module (`python3 -m moe_rl_eks.tools.bench.server --model qwen3`),
with fastapi, uvicorn and pydantic brought as wheels.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import random
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import yaml

from moe_rl_eks.core.run import load_run

from moe_rl_eks.workloads.rollout.engine_api import RowRequest, SamplingParams
from moe_rl_eks.workloads.rl.openai_api import CompletionRequest

from .rollout_counters import rollout_counters

LOCAL_RUN = Path(__file__).resolve().parents[2] / "configs" / "runs" / "local.yaml"


def build(args, root: Path):
    """A run of the benchmark's shape (for the server's limits), an engine serving random weights as version 0, and
    its server."""
    import torch

    from .rollout import QWEN3_30B_A3B, TINY, build_model
    from moe_rl_eks.workloads.rollout.engine import RolloutEngine
    from moe_rl_eks.workloads.rollout.replica import Replica
    from moe_rl_eks.workloads.rollout.server import RolloutServer, make_app
    from moe_rl_eks.workloads.rl.runtime import BackgroundServer
    from moe_rl_eks.workloads.rl.tokenizer import CharTokenizer
    from moe_rl_eks.workloads.rl.weights import DirectoryStore

    data = yaml.safe_load(LOCAL_RUN.read_text())
    model = TINY if args.model == "tiny" else dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    data["model"] = dataclasses.asdict(model)
    data["rollout"].update(max_batch_size=max(args.concurrency) * args.n, max_new_tokens=args.max_tokens)
    data["rl"].setdefault("sampling", {}).update(max_n=max(args.n, data["rl"]["algorithm"]["group_size"]),
                                                 max_prompt_tokens=args.prompt_tokens)
    data["rl"].setdefault("training", {})["output_dir"] = str(root / "out")
    (root / "run.yaml").write_text(yaml.safe_dump(data))
    run = load_run(root / "run.yaml")
    replica = Replica(run)
    torch.manual_seed(0)
    replica.model = build_model(run.model, replica.device, args.compute)
    replica.version, replica.lineage = 0, 0
    # The built-in vocabulary's tokenizer only decodes text here: prompts are token ids over the model's vocabulary.
    engine = RolloutEngine(run, DirectoryStore(root / "weights"), root / "cache", CharTokenizer(), replica)
    server = RolloutServer(run, engine, CharTokenizer(), token=None)
    return engine, BackgroundServer(make_app(server)).start()


def requests(args, vocab: int, count: int) -> list[dict]:
    """The orchestrator's own request record (its sampled token's logprob under the processed distribution, and
    the routed experts when routing replay is on), one distinct random prompt each."""
    rng = random.Random(0)
    return [CompletionRequest(prompt=[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)], n=args.n,
                              max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, seed=i,
                              return_routing=args.routing, logprobs=0, logprob_mode="processed").to_json()
            for i in range(count)]


def direct(engine, bodies: list[dict], concurrency: int) -> tuple[int, list[float], float]:
    def one(i: int, body: dict) -> tuple[int, float]:
        start = time.monotonic()
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], top_p=body["top_p"],
                                seed=body["seed"], logprob_mode=body["logprob_mode"],
                                return_routing=body["return_routing"])
        rows = [RowRequest(tuple(body["prompt"]), params, f"bench-{i}", j) for j in range(body["n"])]
        outputs = engine.submit(rows).result()
        return sum(len(o.token_ids) for o in outputs), time.monotonic() - start

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(len(bodies)), bodies))
    return sum(t for t, _ in results), [s for _, s in results], time.monotonic() - start


def over_http(url: str, bodies: list[dict], concurrency: int, stream: bool) -> tuple[int, list[float], float]:
    """The HTTP client runs in its own process, so the server's figure is not the client's share of one GIL."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_client, url, bodies, concurrency, stream).result()


def _client(url: str, bodies: list[dict], concurrency: int, stream: bool) -> tuple[int, list[float], float]:
    return asyncio.run(_requests(url, bodies, concurrency, stream))


COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')
TOKEN_IDS = re.compile(rb'"token_ids":\[([\d,]*)\]')


async def _requests(url: str, bodies: list[dict], concurrency: int, stream: bool) -> tuple[int, list[float], float]:
    """The orchestrator's HTTP client (aiohttp, keep-alive). Every byte of each answer is read, but only the token
    counts are decoded from it (usage, or each chunk's token ids): an RL answer with logprobs and routed experts
    is ~1.6 MB of JSON at the Qwen3 shape, and parsing it into Python objects is the client's cost, not the
    server's."""
    import aiohttp

    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as client:
        async def one(body: dict) -> tuple[int, float]:
            async with limit:
                start = time.monotonic()
                if not stream:
                    async with client.post("/v1/completions", json=body) as resp:
                        answer = await resp.read()
                        resp.raise_for_status()
                    return int(COMPLETION_TOKENS.search(answer[:1024])[1]), time.monotonic() - start
                tokens = 0
                async with client.post("/v1/completions", json={**body, "stream": True, "return_token_ids": True}
                                       ) as resp:
                    resp.raise_for_status()
                    async for line in resp.content:
                        tokens += sum(ids.count(b",") + 1 for ids in TOKEN_IDS.findall(line) if ids)
                return tokens, time.monotonic() - start

        async with client.get("/v1/models") as resp:  # the pool's first connection is not part of the figure
            await resp.read()
        start = time.monotonic()
        results = await asyncio.gather(*(one(b) for b in bodies))
        wall = time.monotonic() - start
    return sum(t for t, _ in results), [s for _, s in results], wall


def measure(name: str, concurrency: int, call, url: str) -> dict:
    """One run of a way, with the engine's own counters over it: a server that starves the engine leaves it idle
    (busy < wall); one that competes with it for the GIL makes its steps longer (more busy seconds for the same
    device seconds); a slower forward shows as more device seconds per step; a different batching as another step
    count for the same tokens. Read the same way in-process and from a server at --url, so the two compare."""
    before = rollout_counters(url)
    tokens, latencies, wall = call()  # wall: first request sent to last answer, inside the sending process
    after = rollout_counters(url)
    return {"way": name, "concurrency": concurrency, "tokens": tokens, "seconds": wall,
            "tokens_per_second": tokens / wall, **latency(latencies),
            **{f"engine_{key}": after[key] - before[key] for key in ("busy_seconds", "device_seconds")},
            "engine_steps": after["engine_steps"] - before["engine_steps"]}


def latency(seconds: list[float]) -> dict:
    """The median and 95th percentile of requests' latencies."""
    seconds = sorted(seconds)
    return {"p50_s": statistics.median(seconds), "p95_s": seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))]}


def table(results: list[dict]) -> str:
    lines = ["| concurrency | way | tokens | tokens/s | vs engine | p50 latency (s) | p95 latency (s) | wall (s) | "
             "engine busy (s) | steps | device ms/step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["concurrency"]: r["tokens_per_second"] for r in results if r["way"] == "engine"}
    for r in results:
        vs = f"{r['tokens_per_second'] / base[r['concurrency']]:.2f}" if r["concurrency"] in base else "-"
        lines.append(f"| {r['concurrency']} | {r['way']} | {r['tokens']} | {r['tokens_per_second']:.0f} | {vs} | "
                     f"{r['p50_s']:.3f} | {r['p95_s']:.3f} | {r['seconds']:.2f} | {r['engine_busy_seconds']:.2f} | "
                     f"{r['engine_steps']:.0f} | {1e3 * r['engine_device_seconds'] / max(r['engine_steps'], 1):.2f} |")
    return "\n".join(lines)


# Per model: the figure it is for. qwen3 = issue 10's benchmark (concurrency 64 and 256, groups of n = 8, 128-token
# prompts, 256 new tokens); tiny = a quick CPU run.
DEFAULTS = {"qwen3": {"layers": 48, "concurrency": [64, 256], "requests": None, "n": 8, "max_tokens": 256,
                      "prompt_tokens": 128, "repeats": 1},
            "tiny": {"concurrency": [1, 8, 32], "requests": 64, "n": 4, "max_tokens": 32,
                     "prompt_tokens": 32, "repeats": 3}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moerl bench-server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(DEFAULTS), default="tiny",
                        help="qwen3: Qwen3-30B-A3B's shape with --layers layers; tiny: bench-rollout's small model")
    parser.add_argument("--layers", type=int, help="layers of the qwen3 shape (default 48: the whole model)")
    parser.add_argument("--compute", choices=("torch", "triton"),
                        help="the MoE compute backend (default: triton on a GPU, torch on a CPU)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="requests in flight (qwen3 default: 64 256)")
    parser.add_argument("--requests", type=int,
                        help="requests per concurrency and way (qwen3 default: as many as the concurrency)")
    parser.add_argument("--n", type=int, help="rows per request (qwen3 default: 8)")
    parser.add_argument("--max-tokens", type=int, help="new tokens per row (qwen3 default: 256)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt tokens per request (qwen3 default: 128)")
    parser.add_argument("--repeats", type=int, help="runs per way and concurrency (the median is kept)")
    parser.add_argument("--routing", action=argparse.BooleanOptionalAction, default=True,
                        help="ask for the routed experts, as the orchestrator does with routing replay on (default)")
    parser.add_argument("--json", help="also write the results here (after every run)")
    parser.add_argument("--url", help="instead of an engine of its own: send the HTTP way's requests to the server "
                        "running there (e.g. `moerl serve-rollout --model DIR` of --model's shape), to set its "
                        "tokens/s beside this benchmark's at the same shape")
    args = parser.parse_args(argv)
    if args.layers is not None and args.model != "qwen3":
        parser.error("--layers: only the qwen3 shape has a layer count to choose")
    for name, value in DEFAULTS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.compute is None:
        import torch

        args.compute = "triton" if torch.cuda.is_available() else "torch"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    layers = f" --layers {args.layers}" if args.model == "qwen3" else ""
    command = (f"moerl bench-server --model {args.model}{layers} --compute {args.compute} "
               f"--concurrency {' '.join(map(str, args.concurrency))}"
               + (f" --requests {args.requests}" if args.requests is not None else "")
               + f" --n {args.n} "
               f"--max-tokens {args.max_tokens} --prompt-tokens {args.prompt_tokens} --repeats {args.repeats}"
               + ("" if args.routing else " --no-routing"))
    if args.url:
        return against(args, command + f" --url {args.url}")
    results: list[dict] = []  # the median run of each way and concurrency
    measured: list[dict] = []  # every run, saved as it ends: a run cut short by a time limit keeps what it measured

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps({"command": command, "machine": machine(), "results": results,
                                                   "runs": measured}, indent=1))

    with tempfile.TemporaryDirectory(prefix="moerl-bench-server-") as tmp:
        start = time.monotonic()
        engine, http = build(args, Path(tmp))
        try:
            bodies = requests(args, engine.run.model.vocab_size, max(args.requests or c for c in args.concurrency))
            # Warm-up: the decoder is built (KV cache, CUDA graphs) and the prefill shapes of the largest load
            # compile here, not inside the first way's figure.
            warm = [{**b, "max_tokens": 2} for b in bodies[:max(args.concurrency)]]
            direct(engine, warm, max(args.concurrency))
            over_http(http.url, warm[:4], 4, False)  # and the server's first requests (imports, first responses)
            log(f"engine built and warm in {time.monotonic() - start:.1f} s")
            for c in args.concurrency:
                sent = bodies[:args.requests or c]
                ways = {"engine": lambda: direct(engine, sent, c),
                        "HTTP": lambda: over_http(http.url, sent, c, False),
                        "HTTP stream": lambda: over_http(http.url, sent, c, True)}
                # The ways take turns, and each reports its median run: a shared machine's load moves in between.
                runs = {name: [] for name in ways}
                for _ in range(args.repeats):
                    for name, call in ways.items():
                        runs[name].append(measure(name, c, call, http.url))
                        measured.append(runs[name][-1])
                        save()
                        log(f"concurrency {c}, {name}: {runs[name][-1]['tokens_per_second']:.0f} tokens/s, "
                            f"{runs[name][-1]['seconds']:.2f} s, engine busy {runs[name][-1]['engine_busy_seconds']:.2f} s")
                for name in ways:
                    results.append(sorted(runs[name], key=lambda r: r["tokens_per_second"])[args.repeats // 2])
                save()
        finally:
            http.stop()
            engine.stop()
    print(table(results))
    print(f"\n`{command}`")
    return 0


def against(args, command: str) -> int:
    """The HTTP way only, against the server at `--url` (its model of `--model`'s vocabulary): the same requests,
    the same warm-up, the median of `--repeats` runs per concurrency."""
    from .rollout import QWEN3_30B_A3B, TINY

    vocab = (TINY if args.model == "tiny" else QWEN3_30B_A3B).vocab_size
    bodies = requests(args, vocab, max(args.requests or c for c in args.concurrency))
    over_http(args.url, [{**b, "max_tokens": 2} for b in bodies[:max(args.concurrency)]], max(args.concurrency), False)
    results = []
    for c in args.concurrency:
        runs = []
        for _ in range(args.repeats):
            runs.append({**measure("HTTP", c, lambda: over_http(args.url, bodies[:args.requests or c], c, False),
                                   args.url), "url": args.url})
            log(f"concurrency {c}, HTTP to {args.url}: {runs[-1]['tokens_per_second']:.0f} tokens/s")
        results.append(sorted(runs, key=lambda r: r["tokens_per_second"])[args.repeats // 2])
        if args.json:
            Path(args.json).write_text(json.dumps({"command": command, "machine": machine(), "results": results},
                                                  indent=1))
    print(table(results))
    print(f"\n`{command}`")
    return 0


def machine() -> dict:
    import torch

    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
