"""Kernel tests run on the CPU through Triton's interpreter; it must be on before triton builds any kernel."""
import os

os.environ["TRITON_INTERPRET"] = "1"
