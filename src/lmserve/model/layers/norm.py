"""RMSNorm (weight * normalized; Gemma's (1 + weight) is folded into the weight at load), with the fused
residual-add form the decoder uses between sublayers."""

from __future__ import annotations

import torch
from torch import nn

from lmserve import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and kernels.usable(x) and self.weight.dtype == torch.float32:
            return kernels.rmsnorm(x, self.weight, self.eps)
        # Same arithmetic as HF's LlamaRMSNorm: normalise in fp32, scale in the input dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def per_row(self, x: torch.Tensor) -> torch.Tensor:
        """The norm over the last dim of x (..., dim) (q/k heads): on CPU float32 the 2-D kernel over its rows (the
        C decode stack's arithmetic), else forward."""
        if x.dim() > 2 and kernels.usable(x) and self.weight.dtype == torch.float32:
            return kernels.rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return self(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's skip connection and the next norm in one pass: residual = x + residual (updated in
        place on the kernel path), returns (norm(residual), residual)."""
        if x.dim() == 2 and kernels.usable(x) and kernels.usable(residual) and residual.is_contiguous():
            return kernels.rmsnorm(x, self.weight, self.eps, residual=residual), residual
        residual = x + residual
        return self(residual), residual
