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
