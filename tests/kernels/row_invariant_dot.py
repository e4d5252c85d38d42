"""`tl.dot` under Triton's interpreter as a GPU's matrix units compute it, for the exact kernels' tests.

The interpreter computes `tl.dot` with `np.matmul`, i.e. the CPU's BLAS, and some BLAS kernels do not give a row
the same bits at every position of a tile (OpenBLAS 0.3.31's Haswell and Zen sgemm on an AMD EPYC: row 6 of a tile
differs from the same row at position 0; its SkylakeX kernel agrees). A GPU's matrix units give each row of a tile
the same reduction whatever its position, which is what the exact kernels' invariance rests on, so the tests
emulate `tl.dot` that way: each output element accumulates its K products in order (one multiply and one add per
step, elementwise, no BLAS), on every machine alike. conftest.py installs it in the test process; a test's
worker processes (expert-parallel ranks) install it themselves."""
import numpy as np
from triton.runtime import interpreter

_blas_dot = interpreter.InterpreterBuilder.create_dot


def _row_invariant_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8 or a.data.ndim != 2:
        return _blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    acc_dtype = d.data.dtype
    x, y = a.data.astype(acc_dtype), b.data.astype(acc_dtype)
    acc = np.zeros((x.shape[0], y.shape[1]), dtype=acc_dtype)
    for k in range(x.shape[1]):
        acc += x[:, k:k + 1] * y[k:k + 1, :]
    return interpreter.TensorHandle(acc + d.data, d.dtype.scalar)


def install() -> None:
    interpreter.InterpreterBuilder.create_dot = _row_invariant_dot
