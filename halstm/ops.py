"""The thin layer cells are written in: a matmul with a parameter, gate splitting, activations.

Everything here builds TVM tensor expressions; a cell may use raw ``te.compute`` beside it. Only
``matmul`` (and ``linear``, built on it) is special: it is how the compiler sees a matmul, so it can
hoist it out of the time loop or combine it with others. While a cell is being traced for lowering,
``matmul`` asks the active tracer what to return (see ``tracing``).
"""

from __future__ import annotations

import contextlib

import numpy as np
from tvm.sym.analyzer import Analyzer
from tvm import te, tirx, topi  # importing topi gives te.Tensor its elementwise arithmetic operators

MATMUL_TAG = "halstm.matmul"
# The convolutions' reductions (``halstm.models.conv``), by the shape of their sum, which the conv
# recipes schedule by tag
TAPS_TAG = "halstm.taps"  # out[m, c] = sum over the K taps of a window around row m
ROWS_TAG = "halstm.rows"  # out[..., c] = sum over all T * B rows
HEAD_TAG = "halstm.head"  # out[m, h, k] = sum over the R channels of head h

# PyTorch's values at the extremes (inf, 0, NaN in, NaN out), on the CPU (targets/cpu_math.py) and on
# CUDA, where subnormal results flush to zero (TVM builds with --use_fast_math)
sigmoid = topi.sigmoid
tanh = topi.tanh
exp = topi.exp
log = topi.log
sqrt = topi.sqrt


def _broadcast(f, a, b, name: str) -> te.Tensor:
    """``f`` of the elements of a and b (tensors, or a number for one of them) broadcast against
    each other as in NumPy."""
    dtype = (a if isinstance(a, te.Tensor) else b).dtype
    shapes = [dims(t) if isinstance(t, te.Tensor) else () for t in (a, b)]

    def element(t, shape, index):
        if not isinstance(t, te.Tensor):
            return tirx.const(t, dtype)
        index = index[len(index) - len(shape):]
        return t[tuple(0 if d == 1 else i for d, i in zip(shape, index))]

    return te.compute(_broadcast_shape(*shapes),
                      lambda *i: f(element(a, shapes[0], i), element(b, shapes[1], i)), name=name)


def extent(e):
    """An extent as a number, or the expression itself where it is symbolic (the rows of a function
    lowered for any sequence length)."""
    return int(e) if isinstance(e, (int, tirx.IntImm)) else e


def dims(t: te.Tensor) -> tuple:
    """t's shape, each dimension an ``extent``."""
    return tuple(extent(d) for d in t.shape)


def same_extent(a, b) -> bool:
    """Whether two extents, numbers or symbolic expressions, are provably equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return Analyzer().can_prove_equal(a, b)


def _broadcast_shape(*shapes: tuple) -> tuple:
    """NumPy's broadcast of ``shapes``, whose dimensions may be symbolic (equal only to themselves)."""
    numeric = [tuple(d if isinstance(d, int) else -1 for d in s) for s in shapes]
    size = max(map(len, shapes))
    out = []
    for i in range(1, size + 1):
        present = [s[-i] for s in shapes if len(s) >= i and not (isinstance(s[-i], int) and s[-i] == 1)]
        if not present:
            out.append(1)
        elif all(isinstance(d, int) for d in present):
            out.append(np.broadcast_shapes(*[(d,) for d in present])[0])
        elif all(not isinstance(d, int) and same_extent(d, present[0]) for d in present):
            out.append(present[0])
        else:
            raise ValueError(f"shapes {numeric} cannot be broadcast together")
    return tuple(reversed(out))


def maximum(a, b) -> te.Tensor:
    """The larger of a and b, NaN where either is NaN, as torch.maximum (TVM's max returns the other
    operand): comparisons with NaN are false, leaving u + v."""
    return _broadcast(lambda u, v: tirx.Select(u < v, v, tirx.Select(v <= u, u, u + v)), a, b, "maximum")


def minimum(a, b) -> te.Tensor:
    """The smaller of a and b, NaN where either is NaN (torch.minimum)."""
    return _broadcast(lambda u, v: tirx.Select(v < u, v, tirx.Select(u <= v, u, u + v)), a, b, "minimum")


def relu(t: te.Tensor) -> te.Tensor:
    """max(t, 0), NaN for NaN (torch.relu)."""
    return _broadcast(lambda u, zero: tirx.Select(u < zero, zero, u), t, 0.0, "relu")


SERIES_BELOW = 0.25  # |t| under which log1p and expm1 sum their series


def log1p(t: te.Tensor) -> te.Tensor:
    """log(1 + t), exact near 0, where 1 + t rounds (torch.log1p): for |t| < SERIES_BELOW, 2 atanh(z)
    with z = t / (2 + t) as its series to z^9 (|z| < 1/7: within 1e-10 of it)."""
    def value(v):
        z = v / (2.0 + v)
        z2 = z * z
        series = 2.0 * z * (1.0 + z2 * (1 / 3 + z2 * (1 / 5 + z2 * (1 / 7 + z2 * (1 / 9)))))
        return tirx.Select(v * v < SERIES_BELOW * SERIES_BELOW, series, tirx.log(1.0 + v))

    return te.compute(t.shape, lambda *i: value(t(*i)), name="log1p")


def expm1(t: te.Tensor) -> te.Tensor:
    """exp(t) - 1, exact near 0, where exp(t) - 1 cancels (torch.expm1): for |t| < SERIES_BELOW its
    Taylor series to t^9 / 9! (within 1e-12 of it)."""
    def value(v):
        series = 1.0
        for k in range(9, 1, -1):
            series = 1.0 + v * series / float(k)
        return tirx.Select(v * v < SERIES_BELOW * SERIES_BELOW, v * series, tirx.exp(v) - 1.0)

    return te.compute(t.shape, lambda *i: value(t(*i)), name="expm1")


_tracers: list = []


@contextlib.contextmanager
def tracing(tracer):
    """Route every ``matmul`` made inside the block to ``tracer.matmul(a, weight)``."""
    _tracers.append(tracer)
    try:
        yield tracer
    finally:
        _tracers.pop()


def active_tracer():
    """The tracer ``matmul`` routes to now (the innermost ``tracing``), or None."""
    return _tracers[-1] if _tracers else None


def plain_matmul(a: te.Tensor, weight: te.Tensor) -> te.Tensor:
    """``a @ weight.T`` as a plain reduction, accumulated in float32."""
    (rows, depth), (cols, _) = a.shape, weight.shape
    k = te.reduce_axis((0, depth), name="k")
    return te.compute(
        (rows, cols),
        lambda b, n: te.sum(a[b, k].astype("float32") * weight[n, k].astype("float32"), axis=k),
        name=f"matmul_{weight.op.name}",
        tag=MATMUL_TAG,
    )


def matmul(a: te.Tensor, weight: te.Tensor) -> te.Tensor:
    """``a @ weight.T``: a is (B, K), weight a parameter of shape (N, K); the result is (B, N)."""
    if not isinstance(weight.op, te.PlaceholderOp):
        raise TypeError(
            f"matmul: the weight must be a cell parameter (p.name), got the computed tensor "
            f"'{weight.op.name}'"
        )
    if len(a.shape) != 2 or len(weight.shape) != 2 or int(a.shape[1]) != int(weight.shape[1]):
        raise ValueError(
            f"matmul: expected a (B, K) and weight (N, K), got a {tuple(a.shape)} and "
            f"{weight.op.name} {tuple(weight.shape)}"
        )
    if _tracers:
        return _tracers[-1].matmul(a, weight)
    return plain_matmul(a, weight)


def linear(a: te.Tensor, weight: te.Tensor, bias: te.Tensor | None = None) -> te.Tensor:
    """``a @ weight.T + bias``, as torch.nn.functional.linear."""
    y = matmul(a, weight)
    return y if bias is None else y + bias


def split(t: te.Tensor, parts: int) -> list[te.Tensor]:
    """Split the last axis of ``t`` into ``parts`` equal chunks (gates stacked as in PyTorch)."""
    *lead, width = dims(t)
    if width % parts:
        raise ValueError(f"split: last axis {width} is not divisible into {parts} parts")
    size = width // parts

    def chunk(p):
        return te.compute(
            (*lead, size), lambda *i: t[(*i[:-1], i[-1] + p * size)], name=f"{t.op.name}_{p}"
        )

    return [chunk(p) for p in range(parts)]


CONCAT_TAG = "halstm.concat"


def concat(*parts: te.Tensor) -> te.Tensor:
    """The (B, n_i) parts side by side: (B, sum n_i). Its op's ``input_tensors`` are the parts in
    order (when distinct), so that a matmul over a concatenation can be split by them: greedy
    decoding hoists the share of the parts that do not change from step to step."""
    widths = [int(p.shape[1]) for p in parts]

    def value(b, j):
        start = sum(widths) - widths[-1]
        v = parts[-1][b, j - start]
        for p, width in zip(parts[-2::-1], widths[-2::-1]):
            start -= width
            v = te.if_then_else(j < start + width, p[b, j - start], v)
        return v

    return te.compute((parts[0].shape[0], sum(widths)), value, name="concat", tag=CONCAT_TAG)


def embedding(table: te.Tensor, ids: te.Tensor) -> te.Tensor:
    """The rows of ``table`` (V, E) at ``ids`` (B,): (B, E), as torch.nn.functional.embedding."""
    return te.compute((ids.shape[0], table.shape[1]), lambda b, j: table[ids[b], j], name="embedding")


def argmax(t: te.Tensor) -> te.Tensor:
    """Each row's index of its largest value, the first one on ties (as torch.argmax): (B,) int32."""
    return topi.argmax(t, axis=1)


def layer_norm(t: te.Tensor, gamma: te.Tensor, beta: te.Tensor | None = None, eps: float = 1e-5) -> te.Tensor:
    """``(t - mean) / sqrt(var + eps) * gamma + beta`` over the last axis of a (B, N) tensor, as
    torch.nn.functional.layer_norm (biased variance); the statistics and the result in float32.
    The two sums are the cell's own reductions: recipes schedule them as such."""
    rows, width = dims(t)
    name = t.op.name

    def wide(b, n):
        return t[b, n].astype("float32")

    k = te.reduce_axis((0, width), name="k")
    total = te.compute((rows,), lambda b: te.sum(wide(b, k), axis=k), name=f"{name}_sum")
    k = te.reduce_axis((0, width), name="k")
    deviation = te.compute((rows,), lambda b: te.sum((wide(b, k) - total[b] / width) * (wide(b, k) - total[b] / width),
                                                     axis=k), name=f"{name}_sqdev")

    def value(b, n):
        normed = (wide(b, n) - total[b] / width) * te.rsqrt(deviation[b] / width + eps) * gamma[n].astype("float32")
        return normed if beta is None else normed + beta[n].astype("float32")

    return te.compute((rows, width), value, name=f"{name}_normed")
