"""halstm: recurrent cells written as math, compiled by TVM with separate schedule recipes.

    cell = halstm.LSTM(input_size=512, hidden_size=512)
    f = halstm.compile(cell, steps=100, batch=64)             # CPU by default
    y, states = f(x, cell.init_parameters(seed=0))            # x: (T, B, I)

Where things live: cells and their language in ``halstm.cell``/``halstm.ops``/``halstm.cells``,
the planner in ``halstm.plan``, lowering in ``halstm.lower``, the float64 oracle in
``halstm.reference``, recipes in ``halstm.schedules`` (``schedules/``), targets in
``halstm.targets`` (``targets/``).
"""

from .cell import Cell, Params
from .cells import GRU, LSTM, PeepholeLSTM, ResetBeforeGRU
from .compiler import CompiledCell, compile
from .lower import lower
from .ops import exp, linear, matmul, sigmoid, split, tanh
from .plan import make_plan
from .reference import reference

__all__ = [
    "Cell", "Params", "LSTM", "GRU", "PeepholeLSTM", "ResetBeforeGRU", "compile", "CompiledCell",
    "lower", "make_plan", "reference", "matmul", "linear", "split", "sigmoid", "tanh", "exp",
]
