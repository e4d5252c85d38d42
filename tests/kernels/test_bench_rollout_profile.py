"""`moerl bench-rollout --profile`: the profiled decode steps run the forward the measured ones do, the exact
backend's for `--compute exact` (a first H200 profile had run its MoE compute beside the triton forward). A tiny
model under Triton's interpreter."""
import dataclasses

import torch

from moe_rl_eks.tools.bench import rollout
from moe_rl_eks.workloads.model import MoETransformer


def test_profiled_decode_steps_run_the_forward_backend_they_are_given(monkeypatch):
    built = []

    class Recording(rollout.Decoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(type(self.runner.kernels).__name__)

    monkeypatch.setattr(rollout, "Decoder", Recording)
    torch.manual_seed(0)
    model = MoETransformer(dataclasses.replace(rollout.TINY, num_hidden_layers=1)).eval()
    rollout.use_compute(model, "exact")
    profiled = rollout.profile_steps(model, 1, 3, 2, None, "exact")
    assert built == ["ExactForwardKernels"] and profiled["batch"] == 1
