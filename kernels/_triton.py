"""What every kernel module shares: the interpreter switch and the device check."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.testing
import triton.language as tl

# TRITON_INTERPRET=1 (the CPU test path) decides at import time how kernels are built.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Triton 3.7.1's interpreter multiplies bf16 operands of tl.dot as raw uint16 bits, so under the interpreter the
# operands are widened to fp32 first; compiled kernels keep bf16 operands for the tensor cores.
UPCAST_DOT = tl.constexpr(INTERPRET)


@triton.jit
def dot_acc(a, b, acc):
    """acc + a @ b with fp32 accumulation."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


# Autotuning of the decode kernels, which run for microseconds: a short timing per config (the default, 25 ms of
# warm-up and 100 ms of repetitions per config and shape, would add tens of seconds to an engine's start).
quick_bench = functools.partial(triton.testing.do_bench, warmup=5, rep=20)


def check_device(name: str, t: torch.Tensor) -> None:
    if not (t.is_cuda or INTERPRET):
        raise ValueError(f"{name} is on {t.device}; the triton backend needs CUDA tensors "
                         "(or TRITON_INTERPRET=1 to run its kernels on the CPU)")


@functools.cache
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def within(configs: list, block: str, size: int) -> list:
    """The autotune configs whose `block` (a reduction block) is no wider than `size` rounded up to a power of 2,
    or the narrowest ones when none is: a wider block only adds masked lanes, and small test shapes then compile one
    or two configs instead of all."""
    limit = max(next_pow2(size), min(c.kwargs[block] for c in configs))
    return [c for c in configs if c.kwargs[block] <= limit]
