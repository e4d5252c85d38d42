"""The floor every RL role shares: the wire records (`protocol`), the rollout servers' HTTP API (`openai_api`: what
the orchestrator sends and the server accepts), the weight store (`weights`) and the device channel between roles on one GPU (`device_weights`), prompts (`data`), rewards,
tokenizers, the algorithms and losses (pure), JSON-over-HTTP and metrics plumbing (`runtime`), model directories
served without a run (`model_dir`) and where checkpoints live (`checkpoint_dirs`). It imports the model, moe,
kernels and core, never a role (rollout/, trainer/, orchestrator/) nor tools/."""
