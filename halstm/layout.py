"""How a GEMM's stacked weights are stored (``PackedLayout``, a recipe's choice) and the tensor
expressions that stack, pack and multiply by them, exact float32 as three TF32 products included
(``tf32_split``): what lowering writes into a program and recipes read of its layout."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import tvm
from tvm import te

from .cell import Params, placeholders
from .plan import Gemm, Plan

ACCUMULATE = "float32"


@dataclass(frozen=True)
class PackedLayout:
    """How a GEMM's stacked weights are stored, a choice the recipe makes: (K, N) rows; with
    ``k_major`` (N, K), each column's K weights contiguous (wgmma's K-major operand, the only one
    it reads for TF32); or with ``tile`` strips (ceil(N / tile), K, tile), zero-padded, each strip
    contiguous. With ``tf32x3`` each float32 GEMM is three products of operands that TF32 holds
    exactly (``tf32_split``): K three times over, the weights [w_b; w_s; w_b]. With ``hoisted_only``
    ``k_major`` and ``tf32x3`` are the hoisted GEMMs' alone; the step's keep (K, N) rows (``of``).

    With ``units``, the columns of a GEMM whose N is a whole number G of gates of the state width
    ``width`` (LSTM: N = 4H) are stored grouped by units: ``units`` units of gate 0, the same units
    of gate 1, ..., of gate G-1, then the next units. A column tile of G * units then holds every
    gate of its units, so the elementwise math can follow the GEMM in the same kernel. The GEMM's
    result is stored that way too; ``column`` maps a column of the cell's math to where it is."""

    tile: int | None = None
    units: int | None = None
    width: int = 0
    k_major: bool = False
    tf32x3: bool = False
    hoisted_only: bool = False
    split_k: int = 1

    def __post_init__(self):
        if self.k_major and self.tile is not None:
            raise ValueError("a k_major layout has no strips")

    def of(self, gemm: Gemm) -> PackedLayout:
        """The layout of ``gemm``'s weights and operand."""
        return PackedLayout() if self.hoisted_only and gemm.stage > 0 else self

    def shape(self, depth: int, rows: int) -> tuple[int, ...]:
        depth *= 3 if self.tf32x3 else 1
        if self.tile is not None:
            return (-(-rows // self.tile), depth, self.tile)
        return (rows, depth) if self.k_major else (depth, rows)

    def load(self, packed: te.Tensor, k, n):
        if self.tile is not None:
            return packed[n // self.tile, k, n % self.tile]
        return packed[n, k] if self.k_major else packed[k, n]

    def unpack(self, *i) -> tuple:
        """(k, n) of the element at index ``i`` of a packed buffer: ``load``'s inverse."""
        if self.tile is not None:
            return i[1], i[0] * self.tile + i[2]
        return (i[1], i[0]) if self.k_major else i

    def grouped(self, rows: int) -> bool:
        """Whether a GEMM of ``rows`` columns is stored grouped by units."""
        return bool(self.units) and rows % self.width == 0 and self.width % self.units == 0

    def column(self, n, rows: int):
        """Where column ``n`` (of the cell's math) of a GEMM result of ``rows`` columns is stored."""
        if not self.grouped(rows):
            return n
        gates, gate, unit = rows // self.width, n // self.width, n % self.width
        return unit // self.units * (gates * self.units) + gate * self.units + unit % self.units

    def logical(self, p, rows: int):
        """The column of the cell's math stored at column ``p``: ``column``'s inverse."""
        if not self.grouped(rows):
            return p
        group, within = p // (rows // self.width * self.units), p % (rows // self.width * self.units)
        return within // self.units * self.width + group * self.units + within % self.units


def columns_of(t: te.Tensor, start: int, width: int, name: str, layout: PackedLayout = PackedLayout()) -> te.Tensor:
    """Columns start .. start + width of t (of the cell's math; stored as ``layout`` says)."""
    rows = int(t.shape[1])
    return te.compute((t.shape[0], width), lambda b, n: t[b, layout.column(n + start, rows)], name=name)


def stacked(gemm: Gemm, params: Params, n, k):
    """Row n, column k of the weights of a GEMM's matmuls stacked in call order (zero past them)."""
    members = [(gemm.offset(m), params[m.weight]) for m in gemm.members]
    v = te.const(0, members[0][1].dtype)
    for start, w in reversed(members):
        v = te.if_then_else(n < start + int(w.shape[0]), w[n - start, k], v)
    return v


TF32_BITS = 0xFFFFE000  # sign, exponent and the 10 mantissa bits TF32 keeps
TF32_HALF = 0x1000  # half a unit of TF32's last mantissa bit


def tf32_big(v):
    """v rounded to TF32's 10 mantissa bits (to nearest, ties away from zero), as float32."""
    bits = tvm.tirx.reinterpret("uint32", v) + tvm.tirx.const(TF32_HALF, "uint32")
    return tvm.tirx.reinterpret("float32", bits & tvm.tirx.const(TF32_BITS, "uint32"))


def tf32_small(v):
    """What ``tf32_big`` leaves of v, itself rounded to TF32 (|a_s| <= 2^-11 |v|)."""
    return tf32_big(v - tf32_big(v))


def tf32_split(a: te.Tensor, name: str) -> te.Tensor:
    """[a_s, a_b, a_b] along K: a_b = tf32_big(a), a_s = tf32_small(a). Against weights [w_b; w_s;
    w_b] the GEMM is a_s w_b + a_b w_s + a_b w_b = a w - (a_s w_s + what the rounding of a_s, w_s
    drops): a relative error of about 2^-22 a product, which TF32 tensor cores then take exactly
    (3xTF32, as CUTLASS offers it). The small products come first, summed before the large ones:
    added to the large sum they lost their low bits. H100, LSTM T=100 against float64: (100,256,1024)
    6.0e-6, (100,64,2048) 7.1e-6 this way; 1.1e-5 and 1.9e-5 with the small products last and a_s
    left to the tensor cores' truncation; FFMA 5.5e-6."""
    depth = int(a.shape[1])

    def at(b, k):
        v = a[b, k % depth]
        return te.if_then_else(k < depth, tf32_small(v), tf32_big(v))

    return te.compute((a.shape[0], 3 * depth), at, name=name)


def packed_weights(gemm: Gemm, params: Params, layout: PackedLayout, name: str) -> te.Tensor:
    """The weights of a GEMM's matmuls stacked in call order, in ``layout`` (``tf32x3``: [w_b; w_s;
    w_b] along K, as ``tf32_split`` pairs them)."""

    def value(k, p):
        if not layout.tf32x3:
            return stacked(gemm, params, layout.logical(p, gemm.rows), k)
        w = stacked(gemm, params, layout.logical(p, gemm.rows), k % gemm.depth)
        return te.if_then_else(k // gemm.depth == 1, tf32_small(w), tf32_big(w))

    return te.compute(layout.shape(gemm.depth, gemm.rows), lambda *i: value(*layout.unpack(*i)), name=name)


def packing_function(plan: Plan, dtype: str, layout: PackedLayout) -> tvm.tirx.PrimFunc:
    """The step GEMMs' packed weights (``w_packed<i>``) from the parameters, as the prologue of
    ``lower``'s function computes them, alone."""
    _, _, params = placeholders(plan.cell, 1, dtype)
    packed = [packed_weights(g, params, layout.of(g), f"w_packed{i}") for i, g in enumerate(plan.gemms) if g.stage > 0]
    return te.create_prim_func([*params.values(), *packed])


def packed_gemm(operand: te.Tensor, packed: te.Tensor, layout: PackedLayout, rows: int, name: str,
          slices: int = 1) -> te.Tensor:
    """operand @ packed; with ``slices``, K summed in that many slices (PackedLayout.split_k)."""
    depth = int(operand.shape[1]) // slices
    k = te.reduce_axis((0, depth), name="k")

    def product(b, kk, n):
        return operand[b, kk].astype(ACCUMULATE) * layout.load(packed, kk, n).astype(ACCUMULATE)

    if slices == 1:
        return te.compute((operand.shape[0], rows), lambda b, n: te.sum(product(b, k, n), axis=k), name=name)
    sliced = te.compute((slices, operand.shape[0], rows),
                        lambda s, b, n: te.sum(product(b, s * depth + k, n), axis=k), name=name)
    return te.compute((operand.shape[0], rows),
                      lambda b, n: functools.reduce(operator.add, (sliced[s, b, n] for s in range(slices))),
                      name=f"{name}_sum")
