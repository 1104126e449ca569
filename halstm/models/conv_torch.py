"""PyTorch modules for lightweight and dynamic convolution: fairseq's ``LightweightConv1dTBC`` and
``DynamicConv1dTBC`` (their arguments, (T, B, C) layout and state_dict), run by halstm.

Forward and backward are compiled functions (``conv.forward_program``, ``conv.backward_program``),
built on first use per shape, options, dtype and device, then cached. They are ``torch.library`` ops
with their backward registered (``register_autograd``), and fake implementations for
``torch.compile``. Tensors pass by DLPack on torch's current CUDA stream; outputs and scratch
buffers are allocated by torch.

Not supported: ``weight_dropout`` > 0, incremental (step-by-step) decoding, a separate ``query``,
``renorm_padding`` and ``in_proj`` of the dynamic layer.
"""

from __future__ import annotations

import torch

from halstm import targets
from halstm.schedules.conv_cpu import CpuConv
from halstm.schedules.conv_cuda import CudaConv

from .conv import ConvLayer, backward_program, forward_program
from .op import CompiledOp, compile_op

RECIPES = (CpuConv(), CudaConv())
_COMPILED: dict[tuple, CompiledOp] = {}


def compiled(layer: ConvLayer, backward: bool, device: torch.device) -> CompiledOp:
    """The compiled forward or backward pass of ``layer`` on ``device`` (cached)."""
    key = (layer, backward, str(device))
    if key not in _COMPILED:
        if device.type == "cpu":
            target = targets.resolve("cpu")
        else:
            target = targets.CudaTarget.detect(device.index or 0)
        program = (backward_program if backward else forward_program)(layer)
        _COMPILED[key] = compile_op(program, target, RECIPES)
    return _COMPILED[key]


def _layer(x, heads: int, kernel_size: int, padding_l: int, weight_softmax: bool, dynamic: bool) -> ConvLayer:
    T, B, C = x.shape
    dtype = str(x.dtype).replace("torch.", "")
    return ConvLayer(T, B, C, kernel_size, heads, padding_l, weight_softmax, dynamic, dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


@torch.library.custom_op("halstm::lightweight_conv", mutates_args=())
def lightweight_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, padding_l: int,
                     weight_softmax: bool) -> torch.Tensor:
    """x (T, B, C), weight (H, K), bias (C,) -> (T, B, C)."""
    layer = _layer(x, *weight.shape, padding_l, weight_softmax, dynamic=False)
    return compiled(layer, False, x.device)(_rows(x), weight, bias)["y"].view(x.shape)


@torch.library.custom_op("halstm::lightweight_conv_backward", mutates_args=())
def lightweight_conv_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, padding_l: int,
                              weight_softmax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dweight, dbias."""
    layer = _layer(x, *weight.shape, padding_l, weight_softmax, dynamic=False)
    out = compiled(layer, True, x.device)(_rows(x), weight, _rows(grad))
    return out["dx"].view(x.shape), out["dweight"], out["dbias"]


@torch.library.custom_op("halstm::dynamic_conv", mutates_args=())
def dynamic_conv(x: torch.Tensor, weight_linear: torch.Tensor, bias_linear: torch.Tensor, bias: torch.Tensor,
                 heads: int, padding_l: int, weight_softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, B, C), the kernel-predicting Linear (H * K, C) and (H * K,), bias (C,) -> y (T, B, C)
    and the normalised kernels (T * B, H, K) the backward pass reads."""
    layer = _layer(x, heads, weight_linear.shape[0] // heads, padding_l, weight_softmax, dynamic=True)
    out = compiled(layer, False, x.device)(_rows(x), weight_linear, bias_linear, bias)
    return out["y"].view(x.shape), out["kernel"]


@torch.library.custom_op("halstm::dynamic_conv_backward", mutates_args=())
def dynamic_conv_backward(grad: torch.Tensor, x: torch.Tensor, kernel: torch.Tensor, weight_linear: torch.Tensor,
                          padding_l: int, weight_softmax: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, dweight_linear, dbias_linear, dbias."""
    _, heads, K = kernel.shape
    layer = _layer(x, heads, K, padding_l, weight_softmax, dynamic=True)
    out = compiled(layer, True, x.device)(_rows(x), kernel, weight_linear, _rows(grad))
    return out["dx"].view(x.shape), out["dweight_linear"], out["dbias_linear"], out["dbias"]


@lightweight_conv.register_fake
def _(x, weight, bias, padding_l, weight_softmax):
    return torch.empty_like(x)


@lightweight_conv_backward.register_fake
def _(grad, x, weight, padding_l, weight_softmax):
    return torch.empty_like(x), torch.empty_like(weight), x.new_empty(x.shape[-1])


@dynamic_conv.register_fake
def _(x, weight_linear, bias_linear, bias, heads, padding_l, weight_softmax):
    T, B, _ = x.shape
    return torch.empty_like(x), x.new_empty(T * B, heads, weight_linear.shape[0] // heads)


@dynamic_conv_backward.register_fake
def _(grad, x, kernel, weight_linear, padding_l, weight_softmax):
    N, C = weight_linear.shape
    return torch.empty_like(x), torch.empty_like(weight_linear), x.new_empty(N), x.new_empty(C)


def _save_lightweight(ctx, inputs, output):
    x, weight, _, ctx.padding_l, ctx.weight_softmax = inputs
    ctx.save_for_backward(x, weight)


def _lightweight_grads(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dweight, dbias = lightweight_conv_backward(grad.contiguous(), x, weight, ctx.padding_l, ctx.weight_softmax)
    return dx, dweight, dbias, None, None


def _save_dynamic(ctx, inputs, output):
    x, weight_linear, _, _, _, ctx.padding_l, ctx.weight_softmax = inputs
    ctx.save_for_backward(x, output[1], weight_linear)
    ctx.mark_non_differentiable(output[1])


def _dynamic_grads(ctx, grad, _grad_kernel):
    x, kernel, weight_linear = ctx.saved_tensors
    grads = dynamic_conv_backward(grad.contiguous(), x, kernel, weight_linear, ctx.padding_l, ctx.weight_softmax)
    return (*grads, None, None, None)


lightweight_conv.register_autograd(_lightweight_grads, setup_context=_save_lightweight)
dynamic_conv.register_autograd(_dynamic_grads, setup_context=_save_dynamic)


class _Conv1dTBC(torch.nn.Module):
    """What both layers share: sizes, padding (K - 1 is causal; None is centred, K // 2)."""

    def __init__(self, input_size: int, kernel_size: int, padding_l: int | None, num_heads: int,
                 weight_dropout: float, weight_softmax: bool, dynamic: bool):
        super().__init__()
        if weight_dropout:
            raise NotImplementedError("weight_dropout is not supported: the kernels are used as they are")
        self.input_size, self.kernel_size, self.num_heads = input_size, kernel_size, num_heads
        self.padding_l = kernel_size // 2 if padding_l is None else padding_l
        self.weight_softmax = weight_softmax
        ConvLayer(1, 1, input_size, kernel_size, num_heads, self.padding_l, dynamic=dynamic)  # raises on bad sizes

    def extra_repr(self):
        return (f"{self.input_size}, kernel_size={self.kernel_size}, padding_l={self.padding_l}, "
                f"num_heads={self.num_heads}, weight_softmax={self.weight_softmax}")


class LightweightConv1d(_Conv1dTBC):
    """fairseq's ``LightweightConv1dTBC``: (T, B, C) -> (T, B, C); ``weight`` (H, 1, K), ``bias`` (C,)."""

    def __init__(self, input_size: int, kernel_size: int = 1, padding_l: int | None = None, num_heads: int = 1,
                 weight_dropout: float = 0.0, weight_softmax: bool = False, bias: bool = False):
        super().__init__(input_size, kernel_size, padding_l, num_heads, weight_dropout, weight_softmax, False)
        self.weight = torch.nn.Parameter(torch.empty(num_heads, 1, kernel_size))
        self.bias = torch.nn.Parameter(torch.zeros(input_size)) if bias else None
        torch.nn.init.xavier_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.bias is not None else x.new_zeros(self.input_size)
        return lightweight_conv(x, self.weight.squeeze(1), bias, self.padding_l, self.weight_softmax)


class DynamicConv1d(_Conv1dTBC):
    """fairseq's ``DynamicConv1dTBC``: (T, B, C) -> (T, B, C), the kernels predicted from x by
    ``weight_linear`` (C -> H * K, with a bias if ``bias``), ``conv_bias`` (C,) added to the output."""

    def __init__(self, input_size: int, kernel_size: int = 1, padding_l: int | None = None, num_heads: int = 1,
                 weight_dropout: float = 0.0, weight_softmax: bool = False, bias: bool = False,
                 conv_bias: bool = False):
        super().__init__(input_size, kernel_size, padding_l, num_heads, weight_dropout, weight_softmax, True)
        self.weight_linear = torch.nn.Linear(input_size, num_heads * kernel_size, bias=bias)
        self.conv_bias = torch.nn.Parameter(torch.zeros(input_size)) if conv_bias else None
        torch.nn.init.xavier_uniform_(self.weight_linear.weight)
        if bias:
            torch.nn.init.zeros_(self.weight_linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear, zeros = self.weight_linear, x.new_zeros
        bias_linear = linear.bias if linear.bias is not None else zeros(linear.out_features)
        bias = self.conv_bias if self.conv_bias is not None else zeros(self.input_size)
        y, _ = dynamic_conv(x, linear.weight, bias_linear, bias, self.num_heads, self.padding_l, self.weight_softmax)
        return y
