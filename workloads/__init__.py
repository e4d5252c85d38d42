"""What runs in the images: the model and its expert parallelism (`model`, `moe`), the floor the RL roles share
(`rl`) and the three roles (`rollout`, `trainer`, `orchestrator`). tests/test_layout.py holds who imports whom."""
