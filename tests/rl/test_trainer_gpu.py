"""The trainer on a GPU: bf16 autocast over float32 master weights and optimizer state, and an RL step that
still moves the policy toward the rewarded completion; a one-rank trainer process that writes an asynchronous
checkpoint over the process group it initialises itself, is SIGKILLed and resumes from it. Skipped without CUDA (run on the H200 through the
device tool: tools/gpu_runs/h200-trainer-checkpoint.sh); the CPU twin is test_trainer.py."""
import os
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rl_helpers import rewarded_batch, tiny_run, wait_until, write_run

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


def start_trainer_process(tmp_path: Path, action: str, run_path: Path, out: Path) -> subprocess.Popen:
    """tests/rl/trainer_process.py as torchrun starts a one-rank trainer (env:// variables, LOCAL_RANK 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    with open(tmp_path / f"{action}.log", "w") as log:
        return subprocess.Popen([sys.executable, str(Path(__file__).parent / "trainer_process.py"), action,
                                 str(run_path), str(out)], env=env, stdout=log, stderr=subprocess.STDOUT)


def test_a_one_rank_trainer_sigkilled_after_an_async_checkpoint_resumes_its_step_weights_and_adam_state(tmp_path):
    # PPO: the critic and its moments are checkpointed too
    path = write_run(tmp_path, algorithm={"name": "ppo", "kl_coef": 0.0, "entropy_coef": 0.0})
    saved_file, resumed_file = tmp_path / "saved.pt", tmp_path / "resumed.pt"

    def log(action):
        return (tmp_path / f"{action}.log").read_text()[-3000:]

    writer = start_trainer_process(tmp_path, "checkpoint", path, saved_file)
    try:
        wait_until(lambda: saved_file.exists() or writer.poll() is not None, 120, "the committed checkpoint")
        assert writer.poll() is None, log("checkpoint")  # it died before the commit, as on an NCCL-only group
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    finally:
        writer.kill()
    assert writer.returncode == -signal.SIGKILL
    assert (tmp_path / "out" / "checkpoints" / "LATEST").read_text() == "step-00000001"
    resumer = start_trainer_process(tmp_path, "resume", path, resumed_file)
    try:
        assert resumer.wait(120) == 0, log("resume")
    finally:
        resumer.kill()
    saved, resumed = torch.load(saved_file), torch.load(resumed_file)
    assert saved["device"] == resumed["device"] == "cuda"
    assert saved["backend"] == resumed["backend"] == "cpu:gloo,cuda:nccl"
    assert saved["step"] == resumed["step"] == 1
    assert "critic.net.0.weight.exp_avg" in saved["state"] and resumed["state"].keys() == saved["state"].keys()
    for name, tensor in saved["state"].items():
        assert torch.equal(resumed["state"][name], tensor), name
    assert saved["adam_steps"] == resumed["adam_steps"] == [1.0] * len(saved["adam_steps"])
    # and it trains on: fused AdamW takes its step counts on the GPU only
    assert resumed["adam_steps_after_a_step"] == [2.0] * len(saved["adam_steps"])
