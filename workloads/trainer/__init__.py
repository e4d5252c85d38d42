"""The trainer role: the loop (`loop`, torchrun ranks with expert parallelism inside), one optimizer step
(`step`), training samples as tensors and micro-batches (`microbatch`), weight publication off the critical path
(`publisher`) and DCP checkpoints (`checkpoint`). It imports the shared floor (workloads/rl, model, moe, kernels,
core); never the rollout server or the orchestrator."""
