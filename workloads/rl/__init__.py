"""The RL loop: algorithms and losses (pure), rewards, weight store, rollout server, orchestrator, trainer."""
