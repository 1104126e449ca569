"""Lightweight and dynamic convolution in plain PyTorch, fairseq's unfold formulation: the readable
reference the compiled layers are checked against (its gradients come from autograd), and the
PyTorch baseline of ``benchmarks/conv.py``. x is (T, B, C); heads of C / H consecutive channels."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unfold(x: torch.Tensor, kernel_size: int, padding_l: int) -> torch.Tensor:
    """(T, B, C) -> (T, B, C, K), window k of step t holding x[t + k - padding_l] (zero outside)."""
    T, B, C = x.shape
    padded = F.pad(x, (0, 0, 0, 0, padding_l, kernel_size - 1 - padding_l))
    return padded.as_strided((T, B, C, kernel_size), (B * C, C, 1, B * C))


def lightweight_conv(x, weight, bias, padding_l: int, weight_softmax: bool):
    """weight (H, K) (fairseq's (H, 1, K) squeezed), one kernel a head; bias (C,) or None."""
    T, B, C = x.shape
    H, K = weight.shape
    w = F.softmax(weight, dim=-1) if weight_softmax else weight
    windows = unfold(x, K, padding_l).reshape(T, B, H, C // H, K)
    y = torch.einsum("tbhrk,hk->tbhr", windows, w).reshape(T, B, C)
    return y if bias is None else y + bias


def dynamic_conv(x, weight_linear, bias_linear, bias, heads: int, padding_l: int, weight_softmax: bool):
    """The kernels predicted per step: weight_linear (H * K, C), bias_linear (H * K,) or None."""
    T, B, C = x.shape
    K = weight_linear.shape[0] // heads
    w = F.linear(x, weight_linear, bias_linear).view(T, B, heads, K)
    w = F.softmax(w, dim=-1) if weight_softmax else w
    windows = unfold(x, K, padding_l).reshape(T, B, heads, C // heads, K)
    y = torch.einsum("tbhrk,tbhk->tbhr", windows, w).reshape(T, B, C)
    return y if bias is None else y + bias
