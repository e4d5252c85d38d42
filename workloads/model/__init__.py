"""The MoE model: `MoETransformer` and its `ModelOutput`; checkpoint I/O in `.checkpoint`."""
from .transformer import ModelOutput, MoETransformer

__all__ = ["ModelOutput", "MoETransformer"]
