"""Hardware facts that kernels/ needs from outside itself and that the run configuration checks against, so that
neither restates them and kernels/ imports no run configuration."""
from __future__ import annotations

# The triton MoE kernels read expert rows through TMA (Hopper's tensor memory accelerator), whose row strides must
# be multiples of 16 bytes. kernels/grouped_gemm.py checks the tensors it gets against it; core/run.py refuses a run
# before anything starts unless its rows fit in bfloat16, the dtype the experts compute in on GPUs.
TMA_ROW_BYTES = 16
