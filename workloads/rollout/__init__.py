"""The rollout role: the server (`server`: OpenAI's HTTP API, its models the floor's `rl.openai_api`), the engine
behind it (`engine`, `engine_api`), its model replica (`replica`, in this process or expert-parallel over the
server's GPUs), batched decoding over a paged KV cache (`generation`), streamed text (`detokenizer`) and weight
loading (`weight_staging`). It imports the shared floor (workloads/rl, model, moe, kernels, core); never the
trainer or the orchestrator."""
