"""The `torch` MoECompute backend: plain PyTorch ops, autograd included. Expert GEMMs use torch._grouped_mm on
bf16 CUDA tensors (one kernel for all experts) and a per-expert matmul loop elsewhere (CPU, float32)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .compute import RoutingSpec
from .router import select_experts


def _grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor) -> bool:
    # _grouped_mm needs bf16 on sm90+ and 16-byte aligned rows (hidden and width multiples of 8 elements).
    return (x.is_cuda and x.dtype == torch.bfloat16 and w13.dtype == torch.bfloat16
            and x.shape[-1] % 8 == 0 and w13.shape[1] % 16 == 0)


class TorchCompute:
    name = "torch"
    norm = None  # the model's RMSNorm ops, autograd through them

    def route(self, logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(logits, spec, bias)

    def permute(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        return x[order // k], counts, (order, t, k)

    def unpermute(self, y_sorted: torch.Tensor, weights: torch.Tensor, handle: Any) -> torch.Tensor:
        order, t, k = handle
        y = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted).view(t, k, y_sorted.shape[-1])
        return (y.float() * weights.unsqueeze(-1)).sum(1).to(y_sorted.dtype)

    def experts(self, x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        width = w2.shape[-1]
        if _grouped_mm_supported(x_sorted, w13):
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            h13 = torch._grouped_mm(x_sorted, w13.transpose(-2, -1), offs=offsets)
            h = F.silu(h13[:, :width]) * h13[:, width:]
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        chunks = torch.split(x_sorted, counts.tolist())
        outs = []
        for e, chunk in enumerate(chunks):
            h13 = chunk @ w13[e].t()
            outs.append((F.silu(h13[:, :width]) * h13[:, width:]) @ w2[e].t())
        return torch.cat(outs) if outs else x_sorted[:0]

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def decode(self, x: torch.Tensor, router: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None,
               w13: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        return None  # no whole-layer path: the grouped GEMM is this backend's decode too
