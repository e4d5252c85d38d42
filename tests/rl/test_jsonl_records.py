"""Records a role appends one JSON object a line (metrics.jsonl, trained.jsonl, eval.jsonl) read while it writes:
local-run's progress and the process tests read them mid-run, and a long record is more than one write, so the
last line may be half there."""
import json
import threading

from moe_rl_eks.tools.local_run import read_metrics
from moe_rl_eks.workloads.rl.runtime import read_jsonl


def test_a_half_written_last_record_is_left_for_the_next_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == []  # before the writer's first record
    whole = json.dumps({"step": 0, "reward_mean": 0.5}) + "\n"
    path.write_text(whole + json.dumps({"step": 1, "ids": ["p1"] * 1000})[:300])
    assert read_jsonl(path) == [{"step": 0, "reward_mean": 0.5}]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]


def test_records_read_beside_a_writer_appending_long_lines_are_always_whole(tmp_path):
    path = tmp_path / "trained.jsonl"
    path.touch()
    records = 200

    def write():
        for step in range(records):
            with open(path, "a") as f:  # as the trainer appends: one record a line, ~200 KB each
                f.write(json.dumps({"step": step, "ids": [f"p{step}-{i}" for i in range(20000)]}) + "\n")

    writer = threading.Thread(target=write)
    writer.start()
    seen = []
    while writer.is_alive() or len(seen) < records:
        seen = read_jsonl(path)
        assert [r["step"] for r in seen] == list(range(len(seen)))
    writer.join()
    assert len(seen) == records
