"""One trainer rank in a process of its own, set up as `moerl train` sets one up under torchrun (env:// variables,
init_trainer_process_group, the GPU where there is one), for tests that kill it. Run as a script:

  trainer_process.py checkpoint RUN OUT  one RL step, an asynchronous checkpoint of step 1 while a second step
                                         trains, its commit; what the checkpoint holds goes to OUT, then the
                                         process waits to be killed
  trainer_process.py resume RUN OUT      resume from the newest checkpoint; what it resumed to goes to OUT, with
                                         the AdamW step counts after one more step (a resumed trainer trains on)
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from rl_helpers import rewarded_batch
from trainer_ranks import full_state

from moe_rl_eks.core.run import load_run
from moe_rl_eks.workloads.trainer.loop import Trainer, init_trainer_process_group


def adam_steps(trainer: Trainer) -> list[float]:
    return [float(trainer.optimizer.state[p]["step"]) for group in trainer.optimizer.param_groups
            for p in group["params"]]


def snapshot(trainer: Trainer) -> dict:
    return {"step": trainer.step, "device": trainer.device.type, "backend": str(dist.get_backend()),
            "state": {name: t.cpu() for name, t in full_state(trainer).items()}, "adam_steps": adam_steps(trainer)}


def write(result: dict, out: str) -> None:
    torch.save(result, out + ".tmp")
    os.replace(out + ".tmp", out)  # the test waits for the file: it appears whole


def main(action: str, run_path: str, out: str) -> None:
    init_trainer_process_group()
    trainer = Trainer(load_run(run_path), None, rank=0, world=1)
    if action == "checkpoint":
        trainer.rl_step(rewarded_batch())
        trainer.step = 1
        trainer.save_checkpoint()
        saved = snapshot(trainer)  # what the save copied to host memory before it returned
        trainer.rl_step(rewarded_batch())  # the write runs in the background: training goes on
        trainer.poll_checkpoint(wait=True)
        write(saved, out)
        time.sleep(600)  # SIGKILLed here: no process group torn down, no CUDA context closed
    else:
        assert trainer.try_resume()
        resumed = snapshot(trainer)
        trainer.rl_step(rewarded_batch())
        write({**resumed, "adam_steps_after_a_step": adam_steps(trainer)}, out)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
