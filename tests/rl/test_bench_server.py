"""bench-server's three ways send the same seeded requests, so each generates exactly the same tokens."""
import json

from moe_rl_eks.tools.bench import server as bench_server


def test_engine_http_and_streamed_http_generate_the_same_tokens(tmp_path, capsys):
    out = tmp_path / "results.json"
    assert bench_server.main(["--concurrency", "2", "--requests", "3", "--n", "2", "--max-tokens", "4",
                              "--prompt-tokens", "8", "--repeats", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["way"] for r in results] == ["engine", "HTTP", "HTTP stream"]
    assert len({r["tokens"] for r in results}) == 1 and 3 <= results[0]["tokens"] <= 3 * 2 * 4
    assert "| 2 | HTTP stream |" in capsys.readouterr().out
    for r in results:  # the engine's counters over each run: a step per token at least, the device's part of them
        assert r["engine_steps"] >= 4 and 0 < r["engine_device_seconds"] <= r["engine_busy_seconds"] <= r["seconds"]


def test_bench_server_sends_the_same_requests_to_a_running_server_with_url(tmp_path, capsys):
    # `--url`: only the HTTP way, to a server already serving (tools/gpu_runs/h200-serve-model.sh: serve-rollout
    # --model against bench-server's own engine at the same shape); here a server of the tiny shape
    flags = ["--concurrency", "2", "--requests", "3", "--n", "2", "--max-tokens", "4", "--prompt-tokens", "8",
             "--repeats", "1"]
    engine, http = bench_server.build(bench_server.parse(flags), tmp_path)
    try:
        assert bench_server.main([*flags, "--url", http.url, "--json", str(tmp_path / "url.json")]) == 0
    finally:
        http.stop()
        engine.stop()
    results = json.loads((tmp_path / "url.json").read_text())["results"]
    assert [(r["way"], r["concurrency"]) for r in results] == [("HTTP", 2)]
    assert 3 <= results[0]["tokens"] <= 3 * 2 * 4
    # the served engine's counters, read from its /metrics as for bench-server's own engine
    assert results[0]["engine_steps"] >= 4 and 0 < results[0]["engine_device_seconds"] <= results[0]["engine_busy_seconds"]
    out = capsys.readouterr().out
    assert f"--url {http.url}`" in out and "| 2 | HTTP | " in out and "device ms/step |" in out
