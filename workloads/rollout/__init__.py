"""The rollout role: the server (`server`: OpenAI's HTTP API, its models the floor's `rl.openai_api`), the engine
behind it (`engine`, `engine_api`), its model replica (`replica`, in this process or expert-parallel over the
server's GPUs), continuous-batching decoding (`decoder`) split as a serving engine is (vLLM v1): the `scheduler`,
the `kv_cache_manager`, the `model_runner` and the `sampler`; streamed text (`detokenizer`) and weight loading
(`weight_staging`, from the store or the trainer's GPU memory: `weight_sources`). It imports the shared floor (workloads/rl, model, moe, kernels, core); never the trainer or the
orchestrator."""
