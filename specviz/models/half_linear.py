"""Linear layers with fp16-valued weights, run on the CPU kernel for fp16 weights (kernels/cpu/half_matmul_cpu.cpp).

Whisper's weights are fp16 (the embedded model is a CTranslate2 fp16 conversion); loaded into fp32 they are still
exactly fp16 values, so keeping them as fp16 loses nothing. The kernel reads half the bytes of fp32 and costs
about the same for 1 to ~8 rows, where torch's fp32 linear here costs more for 2 rows than for 1 (its blocking
follows the row count), and gives every row the same bits whatever else shares the call: a verification call of
γ + 1 positions scores each as a one-token step would.
"""

from __future__ import annotations

import torch
from torch import nn

from specviz.models import cpu_kernels


class HalfLinear(nn.Module):
    """nn.Linear's forward with the weight held as fp16 (exactly the fp32 weight it replaces: `from_linear`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % 8 or weight.device.type != "cpu":
            raise ValueError(f"HalfLinear needs a CPU weight with K a multiple of 8, got {tuple(weight.shape)} on "
                             f"{weight.device}")
        # [N, K] fp16 bits as int16: Module.float() / .half() convert floating buffers, and must not convert this one
        # (the bias may be converted: forward reads it as fp32, exact after .float(), rounded after .half())
        self.register_buffer("bits", weight.detach().to(torch.float16).contiguous().view(torch.int16))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())  # [N]

    @property
    def weight(self) -> torch.Tensor:  # [N, K] fp16, a view of `bits`
        return self.bits.view(torch.float16)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> HalfLinear | None:
        """The same layer on fp16 weights, or None where that would change it (a weight fp16 cannot hold exactly,
        not fp32 on the CPU, K not a multiple of 8) or would not pay (the kernels do not build here, or only their
        portable scalar path does: torch's GEMM is then far faster)."""
        w = linear.weight.detach()
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.shape[1] % 8:
            return None
        if not cpu_kernels.available() or not cpu_kernels.vectorized():
            return None
        if not torch.equal(w.half().float(), w):
            return None
        return cls(w, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] fp32 -> [..., N]
        rows = x.reshape(-1, self.in_features).float().contiguous()
        y = cpu_kernels.f16_matmul(rows, self.bits, self.bias.float() if self.bias is not None else None)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def halve_linears(module: nn.Module) -> int:
    """Every nn.Linear under `module` that from_linear takes becomes a HalfLinear, in place (a tied weight gets its
    own fp16 copy; the fp32 tensor stays with whatever else holds it). Returns how many changed."""
    changed = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            half = HalfLinear.from_linear(child)
            if half is not None:
                setattr(module, name, half)
                changed += 1
        else:
            changed += halve_linears(child)
    return changed
