"""``lower_backward``: the backward's three functions over all rows (``prepare.py``, ``rows.py``,
``weights.py``) around the reversed loop, as a ``BackwardProgram``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..adjoint import AdjointCell
from ..cell import Cell
from ..layout import PackedLayout
from ..lowering import INT32_ELEMENTS, ROW_QUANTUM, Program, steps_var
from ..plan import Plan, make_plan
from ..runtime import Arg
from .plan import BackwardPlan
from .prepare import lower_prepare
from .rows import lower_rows
from .weights import lower_weights


@dataclass
class BackwardProgram:
    """The lowered functions, called in order (the adjoint cell compiled as a forward between
    prepare and rows); they share buffers by name."""

    plan: BackwardPlan
    prepare: Program
    rows: Program
    weights: Program
    steps: int | None  # None: any sequence length (the functions' ``STEPS``, T read off each call)
    batch: int
    dtype: str

    @property
    def adjoint(self) -> AdjointCell:
        return self.plan.adjoint

    @property
    def allow_tf32(self) -> bool:
        return self.prepare.allow_tf32

    @property
    def functions(self) -> dict[str, Program]:
        return {"prepare": self.prepare, "rows": self.rows, "weights": self.weights}

    @property
    def args(self) -> list[Arg]:
        """Every buffer of the three functions once, in order of first use."""
        seen = {}
        for a in self.prepare.args + self.rows.args + self.weights.args:
            seen.setdefault(a.name, a)
        return list(seen.values())

    @property
    def longest(self) -> int:
        """The longest sequence the functions take: T, or where they serve any, the longest whose
        buffers int32 indexing reaches: the arguments' and those the functions allocate over all rows,
        as wide as arguments but for their columns padded to whole strips (rounded up to 64 here) and
        their rows to ``ROW_QUANTUM``."""
        if self.steps is not None:
            return self.steps
        return min((INT32_ELEMENTS // (-(-a.shape[1] // 64) * 64) - ROW_QUANTUM) // a.shape[0] - a.extra_steps
                   for a in self.args if a.extra_steps is not None)


def lower_backward(
    cell: Cell,
    steps: int | None,
    batch: int,
    dtype: str = "float32",
    plan: Plan | None = None,
    layout: PackedLayout | None = None,
    gathered: bool = True,
    exact_weights: bool = False,
    allow_tf32: bool = False,
    given_hoisted: bool = False,
    given_results: bool = False,
) -> BackwardProgram:
    """The backward of ``lower(cell, steps, batch, dtype, plan, layout)`` (unscheduled). Its weights
    are packed in ``layout``'s strips, (K, N) otherwise, the gates' columns in order: columns grouped
    by units (a fused step epilogue's layout) would be gathers that autodiff cannot differentiate,
    and the backward packs its own weights, so it needs neither that grouping nor the forward's
    float32 split (``tf32x3``): exact float32 stays on FFMA here. The forward's (N, K) layout
    (``k_major``) is kept with ``allow_tf32``: TF32 wgmma reads no other (on WMMA instead, the weight
    gradients' GEMMs of LSTM (100,64,1024) took 0.9 ms each on an H100). ``gathered``:
    the reversed loop's operand GEMM one a first-stage GEMM, else one a gate (``AdjointCell``);
    ``exact_weights``: the weight gradients' GEMMs on float32 operands (``between_dtype``);
    ``allow_tf32``: float32 GEMMs may run on tensor cores as TF32 (``halstm.compile``'s);
    ``given_hoisted``: prepare takes the hoisted GEMMs' results as arguments (the forward's, rows as
    ``lowering.hoisted_rows``) instead of computing them again; ``given_results``: the first stage's
    too (a forward lowered with ``keep_results``: ``lowering.kept_results``' buffers).
    ``steps=None``: for any T, each function's rows in its first argument ``STEPS`` (``n_steps``)."""
    k_major = bool(layout and layout.k_major and allow_tf32)
    backward = BackwardPlan(plan or make_plan(cell), gathered, exact_weights, k_major and dtype == "float32",
                            given_hoisted, given_results)
    layout = PackedLayout(tile=layout.tile, k_major=k_major) if layout else PackedLayout()
    T = steps_var(steps)
    prepare = lower_prepare(backward, T, batch, dtype, layout)
    rows, kept, shared = lower_rows(backward, T, batch, dtype, layout)
    weights = lower_weights(backward, T, batch, dtype, layout, kept, shared)
    prepare, rows, weights = (replace(p, allow_tf32=allow_tf32) for p in (prepare, rows, weights))
    return BackwardProgram(backward, prepare, rows, weights, steps, batch, dtype)
