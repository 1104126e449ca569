"""A SIMD-friendly float32 exp for LLVM targets.

TVM lowers ``exp`` (and through it ``sigmoid`` and ``tanh``) to ``llvm.exp``, which LLVM turns into
one libm ``expf`` call per vector lane: the fused elementwise block of an LSTM step took 0.30 ms for
B=64, H=512 on two cores, a third of the step's GEMM. This lowering computes exp with Cephes' range
reduction and degree-5 polynomial in plain arithmetic, which vectorises (about 1 ulp for
|x| < 87; NaN propagates; beyond, exp saturates at exp(88) and exp(-87), where sigmoid and tanh
are flat). Other dtypes keep ``llvm.exp``.
"""

from __future__ import annotations

from tvm import tirx
from tvm.tirx import op as tirx_op

_CEPHES = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _exp_f32(value):
    # x is used several times below: bound once, or nested activations (tanh of an expression
    # holding tanh...) grow exponentially when inlined; a cell with one extra tanh took 25 s to build
    x = tirx.Var("exp_arg", value.ty)
    f = lambda v: tirx.const(v, "float32")  # noqa: E731
    clamped = tirx.max(tirx.min(x, f(88.0)), f(-87.0))  # 2**n stays a normal float
    n = tirx_op.floor(clamped * f(1.44269504088896341) + f(0.5))
    r = clamped - n * f(0.693359375) - n * f(-2.12194440e-4)
    poly = f(_CEPHES[0])
    for c in _CEPHES[1:]:
        poly = poly * r + f(c)
    y = poly * r * r + r + f(1.0)
    lanes = str(x.ty)[len("float32"):]  # "" or "x8"
    scale = tirx_op.reinterpret("float32" + lanes, (n.astype("int32" + lanes) + 127) << 23)
    return tirx.Let(x, value, tirx.Select(tirx_op.isnan(x), x, y * scale))


def _lower_exp(call):
    x = call.args[0]
    if str(x.ty).startswith("float32"):
        return _exp_f32(x)
    return tirx.call_llvm_pure_intrin(str(x.ty), "llvm.exp", x)


tirx_op.register_intrin_lowering("tirx.exp", "llvm", f=_lower_exp, level=99)
