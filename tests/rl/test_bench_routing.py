"""`moerl bench-routing` on a small shape: every object written is read back, the orchestrator's process batches
the references and deletes every object once the checkpoint past the batch is committed."""
import json

from moe_rl_eks.tools.bench import routing


def test_bench_routing_moves_every_object_through_and_leaves_none(tmp_path, capsys):
    out = tmp_path / "routing.json"
    assert routing.main(["--groups", "2", "--group-size", "3", "--completion-tokens", "40", "--layers", "3",
                         "--dir", str(tmp_path), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    none, zlib = results["results"]
    positions = 512 + 40 - 1
    assert none["array_bytes"] == none["stored_bytes"] == 6 * positions * 3 * 8  # uint8, uncompressed
    for r in (none, zlib):
        assert r["samples"] == r["orchestrator"]["samples"] == 6 and r["objects_left"] == 0
        assert r["orchestrator"]["deleted_bytes"] == r["stored_bytes"]
        assert r["orchestrator"]["peak_rss_bytes"] >= r["orchestrator"]["baseline_rss_bytes"] > 0
    assert results["routing_off"]["deleted_bytes"] == 0
    assert list(tmp_path.iterdir()) == [out]  # the store's temporary directory is gone
    assert "| routing replay off |" in capsys.readouterr().out
