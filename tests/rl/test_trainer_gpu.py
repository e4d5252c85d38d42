"""The trainer on a GPU: bf16 autocast over float32 master weights and optimizer state, and an RL step that
still moves the policy toward the rewarded completion. Skipped without CUDA (run on the H200 through the device
tool); the CPU twin is test_trainer.py."""
from dataclasses import replace

import pytest
import torch

from rl_helpers import rewarded_batch, tiny_run

from moe_rl_eks.workloads.trainer.microbatch import Sequences
from moe_rl_eks.workloads.trainer.loop import Trainer

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_a_gpu_rl_step_computes_in_bf16_and_steps_float32_master_weights(tmp_path, world_of_one):
    run = tiny_run(tmp_path, algorithm={"name": "grpo", "kl_coef": 0.0, "entropy_coef": 0.0},
                   training={"learning_rate": 0.01})
    run = replace(run, model=replace(run.model, dtype="bfloat16"))
    trainer = Trainer(run, None, rank=0, world=1)
    assert trainer.device.type == "cuda"
    computed = []
    # the trainer scores tokens from the hidden states (chunked log-probs): an attention projection shows the dtype
    trainer.model.model.layers[-1].self_attn.o_proj.register_forward_hook(lambda mod, args, out: computed.append(out.dtype))
    t = Sequences.of(rewarded_batch().samples).to(trainer.device)

    def logp_of_rewarded():
        with torch.no_grad():
            logp = torch.log_softmax(trainer.model(t.inputs).logits.float(), -1)
        return float(logp[0, 4, 9])

    before = logp_of_rewarded()
    computed.clear()
    metrics = trainer.rl_step(rewarded_batch())
    assert computed and set(computed) == {torch.bfloat16}  # the step ran under autocast
    assert logp_of_rewarded() > before
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["grad_norm"]))
    params = list(trainer.model.parameters())
    assert all(p.dtype == torch.float32 and p.is_cuda for p in params)
    states = [s for p in params for s in trainer.optimizer.state[p].values() if torch.is_tensor(s) and s.dim()]
    assert states and all(s.dtype == torch.float32 for s in states)
