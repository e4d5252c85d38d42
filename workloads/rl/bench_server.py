"""`moerl bench-server`: what the HTTP server costs on top of the rollout engine it serves.

The same requests (n rows of a distinct random prompt each, seeded, temperature 1) are sent at each concurrency
three ways: straight to `RolloutEngine.submit` from threads (no HTTP), as `/v1/completions` over HTTP with
keep-alive connections (httpx), and as streamed `/v1/completions` (server-sent events, one chunk per token).
tokens/s = completion tokens / wall time of the whole batch of requests (the median of `--repeats` runs, the ways
taking turns); the latency columns are per request.
The seeds make every way generate the same tokens, so the ratio is the server's overhead at that load.

The model and weights are random (`--model tiny`: bench-rollout's small model; on a CPU this measures the server
against a cheap model, the worst case for its relative overhead; `--model qwen3 --layers N`: Qwen3-30B-A3B's shape
with N layers, for a GPU). The engine takes the GPU when there is
one; on the GPU machine run it as a module (`python3 -m moe_rl_eks.workloads.rl.bench_server`), with fastapi,
uvicorn and httpx brought as wheels.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import random
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import yaml

from moe_rl_eks.core.run import load_run

from .engine_api import RowRequest, SamplingParams

LOCAL_RUN = Path(__file__).resolve().parents[2] / "configs" / "runs" / "local.yaml"


def build(args, root: Path):
    """A run of the benchmark's shape, random weights published as version 0, an engine and its server."""
    import torch

    from ..model import MoETransformer
    from ..model.checkpoint import save_hf
    from .bench_rollout import QWEN3_30B_A3B, TINY
    from .engine import RolloutEngine
    from .rollout_server import RolloutServer, make_app
    from .runtime import BackgroundServer
    from .tokenizer import CharTokenizer
    from .weights import DirectoryStore

    data = yaml.safe_load(LOCAL_RUN.read_text())
    model = TINY if args.model == "tiny" else dataclasses.replace(QWEN3_30B_A3B, num_hidden_layers=args.layers)
    data["model"] = dataclasses.asdict(model)
    data["rollout"].update(max_batch_size=max(args.concurrency) * args.n, max_new_tokens=args.max_tokens)
    data["rl"].setdefault("sampling", {}).update(max_n=max(args.n, data["rl"]["algorithm"]["group_size"]),
                                                 max_prompt_tokens=args.prompt_tokens)
    data["rl"].setdefault("training", {})["output_dir"] = str(root / "out")
    (root / "run.yaml").write_text(yaml.safe_dump(data))
    run = load_run(root / "run.yaml")
    torch.manual_seed(0)
    save_hf(MoETransformer(run.model).state_dict(), run.model, root / "src")
    store = DirectoryStore(root / "weights")
    store.publish(0, root / "src", lineage=0)
    # The built-in vocabulary's tokenizer only decodes text here: prompts are token ids over the model's vocabulary.
    engine = RolloutEngine(run, store, root / "cache", CharTokenizer())
    server = RolloutServer(run, engine, CharTokenizer(), token=None)
    server.load_version(0)
    return engine, BackgroundServer(make_app(server)).start()


def requests(args, vocab: int) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt": [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)], "n": args.n,
             "max_tokens": args.max_tokens, "temperature": 1.0, "seed": i} for i in range(args.requests)]


def direct(engine, bodies: list[dict], concurrency: int) -> tuple[int, list[float], float]:
    def one(i: int, body: dict) -> tuple[int, float]:
        start = time.monotonic()
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body["seed"])
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


async def _requests(url: str, bodies: list[dict], concurrency: int, stream: bool) -> tuple[int, list[float], float]:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one(body: dict) -> tuple[int, float]:
            async with limit:
                start = time.monotonic()
                if not stream:
                    answer = (await client.post("/v1/completions", json=body)).raise_for_status().json()
                    return answer["usage"]["completion_tokens"], time.monotonic() - start
                tokens = 0
                async with client.stream("POST", "/v1/completions",
                                         json={**body, "stream": True, "return_token_ids": True}) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            tokens += sum(len(c.get("token_ids") or ()) for c in json.loads(line[6:])["choices"])
                return tokens, time.monotonic() - start

        await client.get("/v1/models")  # the connection pool's first connection is not part of the figure
        start = time.monotonic()
        results = await asyncio.gather(*(one(b) for b in bodies))
        wall = time.monotonic() - start
    return sum(t for t, _ in results), [s for _, s in results], wall


def measure(name: str, concurrency: int, call) -> dict:
    tokens, latencies, wall = call()  # wall: first request sent to last answer, inside the sending process
    latencies.sort()
    return {"way": name, "concurrency": concurrency, "tokens": tokens, "seconds": wall,
            "tokens_per_second": tokens / wall, "p50_s": statistics.median(latencies),
            "p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]}


def table(results: list[dict]) -> str:
    lines = ["| concurrency | way | tokens | tokens/s | vs engine | p50 latency (s) | p95 latency (s) |",
             "|---|---|---|---|---|---|---|"]
    base = {r["concurrency"]: r["tokens_per_second"] for r in results if r["way"] == "engine"}
    for r in results:
        lines.append(f"| {r['concurrency']} | {r['way']} | {r['tokens']} | {r['tokens_per_second']:.0f} | "
                     f"{r['tokens_per_second'] / base[r['concurrency']]:.2f} | {r['p50_s']:.3f} | {r['p95_s']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moerl bench-server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "qwen3"), default="tiny",
                        help="tiny: bench-rollout's small model; qwen3: Qwen3-30B-A3B's shape with --layers layers")
    parser.add_argument("--layers", type=int, default=4, help="layers of the qwen3 shape")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency and way")
    parser.add_argument("--n", type=int, default=4, help="rows per request")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs per way and concurrency (the median is kept)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moerl-bench-server-") as tmp:
        engine, http = build(args, Path(tmp))
        try:
            bodies = requests(args, engine.run.model.vocab_size)
            direct(engine, bodies[:4], 4)  # warm-up: first steps allocate the decoder
            results = []
            for c in args.concurrency:
                ways = {"engine": lambda: direct(engine, bodies, c),
                        "HTTP": lambda: over_http(http.url, bodies, c, False),
                        "HTTP stream": lambda: over_http(http.url, bodies, c, True)}
                # The ways take turns, and each reports its median run: a shared machine's load moves in between.
                runs = {name: [] for name in ways}
                for _ in range(args.repeats):
                    for name, call in ways.items():
                        runs[name].append(measure(name, c, call))
                for name in ways:
                    results.append(sorted(runs[name], key=lambda r: r["tokens_per_second"])[args.repeats // 2])
        finally:
            http.stop()
            engine.stop()
    text = table(results)
    print(text)
    command = (f"moerl bench-server --model {args.model} --layers {args.layers} --concurrency " +
               " ".join(map(str, args.concurrency)) +
               f" --requests {args.requests} --n {args.n} --max-tokens {args.max_tokens} "
               f"--prompt-tokens {args.prompt_tokens} --repeats {args.repeats}")
    print(f"\n`{command}`")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
