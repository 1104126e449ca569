"""Lightweight and dynamic convolution (Wu et al., ICLR 2019) as math: forward and backward.

fairseq's semantics (``LightweightConv1dTBC``, ``DynamicConv1dTBC``). The input is (T, B, C), seen here
as the rows m = t * B + b of a (T * B, C) matrix. The C channels form H heads of R = C / H consecutive
channels (channel c is in head c // R); every channel is convolved over time with its head's K taps,
tap k of row m reading time t + k - P, zero outside the sequence (P = padding_l: K - 1 causal,
K // 2 centred):

    y[m, c] = bias[c] + sum_k w[m, c // R, k] * x[m + (k - P) * B, c]

    lightweight  w[m, h, k] = softmax_k weight[h, k]                 one kernel a head for all rows
    dynamic      w[m, h, k] = softmax_k z[m, h * K + k],  z = x @ W^T + beta     predicted per row

(without ``weight_softmax``, w is ``weight`` or z itself). The backward passes are derived by hand
below. Tags mark the computations a recipe schedules by their shape (``halstm.schedules.conv``): a
GEMM, a sum over the K taps of a window, over all rows, or over the channels of a head.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import te, tirx

from halstm.ops import HEAD_TAG, MATMUL_TAG, ROWS_TAG, TAPS_TAG

from .op import OpProgram, make_program

DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class ConvLayer:
    """What a compiled convolution is specialised to: sizes, options, dtype."""

    steps: int
    batch: int
    channels: int
    kernel_size: int
    heads: int
    padding_l: int
    weight_softmax: bool = True
    dynamic: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        sizes = (self.steps, self.batch, self.channels, self.kernel_size, self.heads)
        if any(int(s) < 1 for s in sizes):
            raise ValueError(f"T, B, C, K, H must be positive, got {sizes}")
        if self.channels % self.heads:
            raise ValueError(f"channels ({self.channels}) must be a multiple of heads ({self.heads})")
        if not 0 <= self.padding_l < self.kernel_size:
            raise ValueError(f"padding_l must be in [0, kernel_size), got {self.padding_l} for K={self.kernel_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    rows = property(lambda self: self.steps * self.batch)
    head_size = property(lambda self: self.channels // self.heads)
    kernel_width = property(lambda self: self.heads * self.kernel_size)  # the Linear's outputs

    def shift(self, k):
        """Rows from a row to its tap k: (k - P) time steps of B rows."""
        return (k - self.padding_l) * self.batch


def forward_program(layer: ConvLayer) -> OpProgram:
    """(x, weight, bias) -> y, or (x, weight_linear, bias_linear, bias) -> y, kernel (and z, scratch).
    The biases are zeros for a layer without them."""
    n, C, N = layer.rows, layer.channels, layer.kernel_width
    if layer.dynamic:
        params = {"weight_linear": (N, C), "bias_linear": (N,)}
    else:
        params = {"weight": (layer.heads, layer.kernel_size)}
    args = _placeholders(layer, {"x": (n, C), **params, "bias": (C,)})
    out = forward(layer, **args)
    scratch = {"z": out.pop("z")} if layer.dynamic else {}
    return make_program(f"{_kind(layer)}_conv_forward", args, out, scratch)


def backward_program(layer: ConvLayer) -> OpProgram:
    """(x, weight, grad) -> dx, dweight, dbias, or (x, kernel, weight_linear, grad) -> dx,
    dweight_linear, dbias_linear, dbias (and dz, dx_linear, scratch)."""
    n, C, H, K = layer.rows, layer.channels, layer.heads, layer.kernel_size
    if layer.dynamic:
        args = _placeholders(layer, {"x": (n, C), "kernel": (n, H, K), "weight_linear": (layer.kernel_width, C),
                                     "grad": (n, C)})
        out = dynamic_backward(layer, **args)
        scratch = {name: out.pop(name) for name in ("dkernel", "dz", "dx_linear")}
    else:
        args = _placeholders(layer, {"x": (n, C), "weight": (H, K), "grad": (n, C)})
        out, scratch = lightweight_backward(layer, **args), {}
    return make_program(f"{_kind(layer)}_conv_backward", args, out, scratch)


def _placeholders(layer: ConvLayer, shapes: dict) -> dict[str, te.Tensor]:
    return {name: te.placeholder(shape, layer.dtype, name=name) for name, shape in shapes.items()}


def _kind(layer: ConvLayer) -> str:
    return "dynamic" if layer.dynamic else "lightweight"


def forward(layer: ConvLayer, x, bias, weight=None, weight_linear=None, bias_linear=None) -> dict:
    """y; for dynamic, also the normalised kernels w (saved for backward) and the Linear's output z."""
    if layer.dynamic:
        z = _matmul(layer.rows, layer.kernel_width, layer.channels, lambda m, c: x[m, c],
                    lambda c, n: weight_linear[n, c], "z_gemm")
        z = te.compute(z.shape, lambda m, n: z[m, n] + bias_linear[n], name="z")
        w = _normalised(layer, _heads(layer, z))
        kernel = lambda m, h, k: w[m, h, k]  # noqa: E731
    else:
        w = _normalised(layer, weight)
        kernel = lambda m, h, k: w[h, k]  # noqa: E731
    R = layer.head_size
    y = _taps(layer, "y_taps", lambda m, k, c: kernel(m, c // R, k) * _at(layer, m + layer.shift(k), lambda s: x[s, c]))
    y = te.compute(y.shape, lambda m, c: y[m, c] + bias[c], name="y")
    return {"y": y, "kernel": w, "z": z} if layer.dynamic else {"y": y}


def lightweight_backward(layer: ConvLayer, x, weight, grad) -> dict:
    """dx, dweight, dbias from dy = ``grad``.

    dx[s, c]        = sum_k w[h, k] * dy[s - (k - P) B, c]        (the taps, transposed)
    dw[h, k]        = sum_{m, r} dy[m, hR + r] * x[m + (k - P) B, hR + r]
    dweight[h, k]   = w[h, k] (dw[h, k] - sum_j w[h, j] dw[h, j])   (through the softmax)
    """
    R, K, C = layer.head_size, layer.kernel_size, layer.channels
    w = _normalised(layer, weight)
    dx = _taps(layer, "dx", lambda s, k, c: w[c // R, k] * _at(layer, s - layer.shift(k), lambda m: grad[m, c]))
    per_channel = _sum_rows(layer, (K, C), lambda k, c, m: grad[m, c] * _at(layer, m + layer.shift(k),
                                                                              lambda s: x[s, c]), "dw_channel")
    r = te.reduce_axis((0, R), name="r")
    dw = te.compute((layer.heads, K), lambda h, k: te.sum(per_channel[k, h * R + r], axis=r), name="dw")
    dweight = _softmax_backward(w, dw, "dweight") if layer.weight_softmax else dw
    return {"dx": dx, "dweight": dweight, "dbias": _sum_rows(layer, (C,), lambda c, m: grad[m, c], "dbias")}


def dynamic_backward(layer: ConvLayer, x, kernel, weight_linear, grad) -> dict:
    """dx, dweight_linear, dbias_linear, dbias from dy = ``grad`` and the forward's kernels w.

    dw[m, h, k]     = sum_r dy[m, hR + r] * x[m + (k - P) B, hR + r]
    dz              = w (dw - sum_j w dw)            (through the softmax), as (T * B, H * K)
    dW = dz^T @ x,  dbeta = sum_m dz[m, :]
    dx[s, c]        = sum_k w[s', h, k] * dy[s', c]  at s' = s - (k - P) B    (the taps, transposed)
                      + (dz @ W)[s, c]                                          (through the Linear)
    Also returns dw (as "dkernel"), dz and dz @ W: buffers the caller allocates.
    """
    R, K, H = layer.head_size, layer.kernel_size, layer.heads
    n, C, N = layer.rows, layer.channels, layer.kernel_width
    r = te.reduce_axis((0, R), name="r")
    dw = te.compute((n, H, K), lambda m, h, k: te.sum(
        grad[m, h * R + r] * _at(layer, m + layer.shift(k), lambda s: x[s, h * R + r]), axis=r),
        name="dkernel", tag=HEAD_TAG)
    dz = _softmax_backward(kernel, dw, "dz_heads") if layer.weight_softmax else dw
    dz = te.compute((n, N), lambda m, j: dz[m, j // K, j % K], name="dz")
    dweight_linear = _matmul(N, C, n, lambda j, m: dz[m, j], lambda m, c: x[m, c], "dweight_linear")
    dx_linear = _matmul(n, C, N, lambda m, j: dz[m, j], lambda j, c: weight_linear[j, c], "dx_linear")
    dx = _taps(layer, "dx_taps", lambda s, k, c: _at(layer, s - layer.shift(k),
                                                     lambda m: kernel[m, c // R, k] * grad[m, c]))
    dx = te.compute((n, C), lambda s, c: dx_linear[s, c] + dx[s, c], name="dx")
    dbias_linear = _sum_rows(layer, (N,), lambda j, m: dz[m, j], "dbias_linear")
    dbias = _sum_rows(layer, (C,), lambda c, m: grad[m, c], "dbias")
    return {"dx": dx, "dweight_linear": dweight_linear, "dbias_linear": dbias_linear, "dbias": dbias,
            "dkernel": dw, "dz": dz, "dx_linear": dx_linear}


def _at(layer: ConvLayer, row, value):
    """value(row) for a row inside the sequence, zero in the padding before and after it."""
    return te.if_then_else(tirx.all(row >= 0, row < layer.rows), value(row), tirx.const(0, layer.dtype))


def _taps(layer: ConvLayer, name: str, term) -> te.Tensor:
    """out[m, c] = sum_k term(m, k, c) over the K taps."""
    k = te.reduce_axis((0, layer.kernel_size), name="k")
    return te.compute((layer.rows, layer.channels), lambda m, c: te.sum(term(m, k, c), axis=k), name=name,
                      tag=TAPS_TAG)


def _sum_rows(layer: ConvLayer, shape, term, name: str) -> te.Tensor:
    """out[i] = sum_m term(*i, m) over all T * B rows."""
    m = te.reduce_axis((0, layer.rows), name="m")
    return te.compute(shape, lambda *i: te.sum(term(*i, m), axis=m), name=name, tag=ROWS_TAG)


def _matmul(rows: int, cols: int, depth: int, a, b, name: str) -> te.Tensor:
    """out[i, j] = sum_l a(i, l) * b(l, j), however the operands are stored (the recipe sees to it)."""
    l = te.reduce_axis((0, depth), name="l")  # noqa: E741
    return te.compute((rows, cols), lambda i, j: te.sum(a(i, l) * b(l, j), axis=l), name=name, tag=MATMUL_TAG)


def _heads(layer: ConvLayer, z: te.Tensor) -> te.Tensor:
    """z (T * B, H * K) as (T * B, H, K)."""
    K = layer.kernel_size
    return te.compute((layer.rows, layer.heads, K), lambda m, h, k: z[m, h * K + k], name="z_heads")


def _normalised(layer: ConvLayer, w: te.Tensor) -> te.Tensor:
    """softmax over the last axis (the taps), or w itself without ``weight_softmax``."""
    if not layer.weight_softmax:
        return w
    *lead, K = (int(d) for d in w.shape)
    k1, k2 = te.reduce_axis((0, K), name="k"), te.reduce_axis((0, K), name="k")
    top = te.compute(lead, lambda *i: te.max(w[(*i, k1)], axis=k1), name=f"{w.op.name}_max")
    e = lambda *i: te.exp(w(*i) - top(*i[:-1]))  # noqa: E731
    total = te.compute(lead, lambda *i: te.sum(e(*i, k2), axis=k2), name=f"{w.op.name}_sum")
    return te.compute(w.shape, lambda *i: e(*i) / total(*i[:-1]), name=f"{w.op.name}_softmax")


def _softmax_backward(p: te.Tensor, dp: te.Tensor, name: str) -> te.Tensor:
    """The gradient through p = softmax(q) over the last axis: p (dp - sum_j p_j dp_j)."""
    *lead, K = (int(d) for d in p.shape)
    j = te.reduce_axis((0, K), name="j")
    dot = te.compute(lead, lambda *i: te.sum(p[(*i, j)] * dp[(*i, j)], axis=j), name=f"{name}_dot")
    return te.compute(p.shape, lambda *i: p(*i) * (dp(*i) - dot(*i[:-1])), name=name)
