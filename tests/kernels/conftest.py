"""Kernel tests run on the CPU through Triton's interpreter; it must be on before triton builds any kernel (worker
processes inherit it through the environment). Its `tl.dot` is replaced by one that gives a row of a tile the same
bits at every position, as a GPU's does (row_invariant_dot.py says why)."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import row_invariant_dot  # noqa: E402

row_invariant_dot.install()
