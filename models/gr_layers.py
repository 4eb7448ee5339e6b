"""GR's layers as models/gr_model.py's `GrDenseNetwork` runs them: the
FP32 LayerNorm (`layer_norm32`), the MLPs of its content, action, item and
prediction towers (`Mlp`) and one STU layer's projections (`Stu`), each
loading its weights from a GR checkpoint's `dense_dict`. Written from GR's
source (modules/dlrm_hstu.py and what it calls, commit db1bf8f); none of
GR's code is used or needed here."""

import math
from typing import Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn


def layer_norm32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm computed in FP32 and returned in `x`'s dtype (GR's)."""
    return F.layer_norm(x.float(), [x.size(-1)], weight.float(), bias.float(), eps).to(x.dtype)


class Mlp(nn.Module):
    """GR's `Linear, SwishLayerNorm, Linear[, LayerNorm]` (its content,
    action, item and prediction MLPs; eps 1e-5)."""

    final_norm: bool

    def __init__(self, inputs: int, hidden: int, outputs: int, final_norm: bool) -> None:
        super().__init__()
        self.first = nn.Linear(inputs, hidden)
        self.swish_weight = nn.Parameter(torch.ones(hidden))
        self.swish_bias = nn.Parameter(torch.zeros(hidden))
        self.second = nn.Linear(hidden, outputs)
        self.norm_weight = nn.Parameter(torch.ones(outputs))
        self.norm_bias = nn.Parameter(torch.zeros(outputs))
        self.final_norm = final_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h32 = h.float()
        h = (h32 * torch.sigmoid(F.layer_norm(h32, [h.size(-1)], self.swish_weight.float(),
                                              self.swish_bias.float(), 1e-5))).to(h.dtype)
        h = self.second(h)
        if self.final_norm:
            h = layer_norm32(h, self.norm_weight, self.norm_bias, 1e-5)
        return h

    def load(self, state: Dict[str, torch.Tensor], prefix: str) -> None:
        """From GR's `nn.Sequential` weights under `prefix` (`0`, `1`, `2`
        and, with a final norm, `3`)."""
        with torch.no_grad():
            self.first.weight.copy_(state[prefix + "0.weight"])
            self.first.bias.copy_(state[prefix + "0.bias"])
            self.swish_weight.copy_(state[prefix + "1.weight"])
            self.swish_bias.copy_(state[prefix + "1.bias"])
            self.second.weight.copy_(state[prefix + "2.weight"])
            self.second.bias.copy_(state[prefix + "2.bias"])
            if self.final_norm:
                self.norm_weight.copy_(state[prefix + "3.weight"])
                self.norm_bias.copy_(state[prefix + "3.bias"])


class Stu(nn.Module):
    """One STU layer's weights (GR's `STULayer`, no group norm)."""

    heads: int
    hidden: int
    qk: int
    alpha: float

    def __init__(self, dim: int, heads: int, hidden: int, qk: int) -> None:
        super().__init__()
        self.heads, self.hidden, self.qk = heads, hidden, qk
        self.alpha = 1.0 / math.sqrt(qk)
        self.uvqk_weight = nn.Parameter(torch.zeros(dim, (2 * hidden + 2 * qk) * heads))
        self.uvqk_beta = nn.Parameter(torch.zeros((2 * hidden + 2 * qk) * heads))
        self.input_norm_weight = nn.Parameter(torch.ones(dim))
        self.input_norm_bias = nn.Parameter(torch.zeros(dim))
        self.output_weight = nn.Parameter(torch.zeros(3 * hidden * heads, dim))
        self.output_norm_weight = nn.Parameter(torch.ones(hidden * heads))
        self.output_norm_bias = nn.Parameter(torch.zeros(hidden * heads))

    def project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`u` `[T, H * hidden]` (silu), `v` `[T, H, hidden]`, `q`, `k`
        `[T, H, qk]` of tokens `x` `[T, D]`."""
        normed = layer_norm32(x, self.input_norm_weight, self.input_norm_bias, 1e-6)
        uvqk = torch.addmm(self.uvqk_beta, normed, self.uvqk_weight)
        h, hd, qk = self.heads, self.hidden, self.qk
        u, v, q, k = uvqk.split([h * hd, h * hd, h * qk, h * qk], dim=1)
        return F.silu(u), v.unflatten(1, (h, hd)), q.unflatten(1, (h, qk)), k.unflatten(1, (h, qk))

    def finish(self, x: torch.Tensor, attended: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """`x + [u, attn, u * LN(attn)] @ W_o` (the concatenation in FP32,
        as GR's)."""
        a32, u32 = attended.float(), u.float()
        y = u32 * F.layer_norm(a32, [a32.size(-1)], self.output_norm_weight.float(),
                               self.output_norm_bias.float(), 1e-6)
        return torch.addmm(x, torch.cat([u32, a32, y], dim=1).to(x.dtype), self.output_weight)

    def load(self, state: Dict[str, torch.Tensor], prefix: str) -> None:
        with torch.no_grad():
            for mine, theirs in (("uvqk_weight", "_uvqk_weight"), ("uvqk_beta", "_uvqk_beta"),
                                 ("input_norm_weight", "_input_norm_weight"),
                                 ("input_norm_bias", "_input_norm_bias"), ("output_weight", "_output_weight"),
                                 ("output_norm_weight", "_output_norm_weight"),
                                 ("output_norm_bias", "_output_norm_bias")):
                getattr(self, mine).copy_(state[prefix + theirs])
