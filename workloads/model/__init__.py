"""The MoE model: `MoETransformer`, its `ModelOutput` and `KVCache`; checkpoint I/O in `.checkpoint`."""
from .transformer import KVCache, ModelOutput, MoETransformer

__all__ = ["KVCache", "ModelOutput", "MoETransformer"]
