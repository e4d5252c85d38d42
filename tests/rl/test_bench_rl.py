"""bench-rl's arithmetic of the wall-time goal (the runs themselves are `make bench-rl`, not a test)."""
import pytest

from moe_rl_eks.tools.bench.rl import mean_curve, summarize, time_to_reach


def run(mode: str, seed: int, points: list[tuple[int, float, float]], samples_per_second: float = 100.0) -> dict:
    """A bench_run result with an evaluation curve of (target version, seconds, reward) points."""
    curve = [{"target": t, "version": t, "seconds": s, "reward": r} for t, s, r in points]
    return {"mode": mode, "seed": seed, "max_staleness": 0 if mode == "sync" else 2, "samples_per_second": samples_per_second,
            "trainer_idle_fraction": 0.5, "rollout_idle_fraction": 0.5, "mean_staleness": 0.0,
            "trainer_cpu_per_step": 0.1, "shared_cpu_per_step": 0.1, "max_kl": 0.5,
            "final_reward": curve[-1]["reward"], "wall_seconds": curve[-1]["seconds"], "curve": curve}


def test_time_to_reach_is_the_first_evaluated_point_at_or_above_the_reward():
    curve = run("async", 0, [(0, 0.0, 0.2), (10, 4.0, 0.5), (20, 8.0, 0.4), (30, 12.0, 0.6)])["curve"]
    assert time_to_reach(curve, 0.5) == 4.0
    assert time_to_reach(curve, 0.55) == 12.0
    assert time_to_reach(curve, 0.7) is None


def test_mean_curve_averages_reward_and_time_over_the_targets_every_run_has():
    a = run("async", 0, [(0, 0.0, 0.2), (10, 4.0, 0.4), (20, 8.0, 0.6)])
    b = run("async", 1, [(0, 0.0, 0.4), (10, 6.0, 0.6)])  # its publisher skipped past target 20
    assert mean_curve([a, b]) == [{"target": 0, "seconds": 0.0, "reward": pytest.approx(0.3)},
                                  {"target": 10, "seconds": 5.0, "reward": pytest.approx(0.5)}]


def test_summary_measures_async_mean_curve_against_the_sync_runs_mean_final_reward_and_wall_time():
    results = [run("sync", 0, [(0, 0.0, 0.2), (20, 10.0, 0.5), (40, 20.0, 0.7)], samples_per_second=100),
               run("async", 0, [(0, 0.0, 0.2), (20, 5.0, 0.55), (40, 10.0, 0.75)], samples_per_second=200),
               run("async", 1, [(0, 0.0, 0.2), (20, 7.0, 0.45), (40, 14.0, 0.55)], samples_per_second=150),
               run("sync", 1, [(0, 0.0, 0.2), (20, 10.0, 0.4), (40, 20.0, 0.5)], samples_per_second=100)]
    s = summarize(results)
    assert s["sync_final_reward"] == pytest.approx(0.6)  # (0.7 + 0.5) / 2
    assert s["sync_wall_seconds"] == pytest.approx(20.0)
    # async means: target 20 at 6 s with 0.5, target 40 at 12 s with 0.65 -> first >= 0.6 at 12 s
    assert s["async_seconds"] == pytest.approx(12.0)
    assert s["fraction"] == pytest.approx(0.6)
    assert s["throughput_ratio"] == pytest.approx(1.75)
    # sync mean curve: (0 s, 0.2), (10 s, 0.45), (20 s, 0.6); async mean: (0 s, 0.2), (6 s, 0.5), (12 s, 0.65)
    # (three points: the quarters fall on indices 0, 1, 2, 2)
    assert [(x["target"], x["sync_seconds"], x["async_seconds"]) for x in s["levels"]] == [
        (0, 0.0, 0.0), (20, 10.0, 6.0), (40, 20.0, 12.0), (40, 20.0, 12.0)]
    assert [x["ratio"] for x in s["levels"]] == [None, pytest.approx(0.6), pytest.approx(0.6), pytest.approx(0.6)]
    pairs = {p["seed"]: p for p in s["pairs"]}
    assert pairs[0]["async_seconds"] == 10.0 and pairs[0]["fraction"] == pytest.approx(0.5)  # 0.75 >= 0.7 at 10 s
    assert pairs[1]["async_seconds"] == 14.0 and pairs[1]["fraction"] == pytest.approx(0.7)  # 0.55 >= 0.5 at 14 s
    assert pairs[0]["reward_gap_per_version"] == pytest.approx((0.0 + 0.05 + 0.05) / 3)
    assert pairs[1]["reward_gap_last_quarter"] == pytest.approx(0.05)  # the last point: 0.55 - 0.5


def test_summary_says_never_when_async_does_not_reach_the_sync_reward():
    results = [run("sync", 0, [(0, 0.0, 0.2), (20, 10.0, 0.8)]), run("async", 0, [(0, 0.0, 0.2), (20, 5.0, 0.7)])]
    s = summarize(results)
    assert s["async_seconds"] is None and s["fraction"] is None
    assert s["pairs"][0]["fraction"] is None


def test_summary_needs_both_modes():
    with pytest.raises(ValueError, match="sync and one async"):
        summarize([run("sync", 0, [(0, 0.0, 0.2)])])


def test_an_async_run_longer_than_its_sync_pair_is_judged_by_wall_time_and_compared_per_version_where_both_ran():
    # async runs 1.5x the versions (bench-rl's default): it reaches the sync final only after the sync run's last
    # version, yet earlier in wall time; the learning-per-sample gap covers versions 0-40 only
    results = [run("sync", 0, [(0, 0.0, 0.2), (20, 10.0, 0.5), (40, 20.0, 0.8)]),
               run("async", 0, [(0, 0.0, 0.2), (20, 5.0, 0.4), (40, 10.0, 0.7), (60, 15.0, 0.85)])]
    s = summarize(results)
    assert s["async_seconds"] == 15.0 and s["fraction"] == pytest.approx(0.75)
    assert s["pairs"][0]["reward_gap_per_version"] == pytest.approx((0.0 - 0.1 - 0.1) / 3)


def test_time_to_reward_is_judged_like_for_like_and_says_whether_a_level_holds():
    from moe_rl_eks.tools.bench.rl import like_for_like

    sync = [{"seconds": t, "reward": r} for t, r in ((0, 0.1), (10, 0.5), (20, 0.8), (30, 0.9))]
    # async gets there in half the time but falls back from 0.9 to 0.7 afterwards
    asyn = [{"seconds": t, "reward": r} for t, r in ((0, 0.1), (5, 0.5), (10, 0.9), (15, 0.7), (20, 0.88))]
    low, top = like_for_like({"sync": sync, "async": asyn}, [0.5, 0.9])
    assert (low["sync"], low["async"], low["ratio"]) == ({"seconds": 10, "holds": True},
                                                          {"seconds": 5, "holds": True}, 0.5)
    assert top["async"] == {"seconds": 10, "holds": False} and top["ratio"] == pytest.approx(10 / 30)
    never = like_for_like({"sync": sync, "async": asyn[:2]}, [0.9])[0]
    assert never["async"] == {"seconds": None, "holds": False} and never["ratio"] is None
