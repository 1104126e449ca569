"""halstm: recurrent cells written as math, compiled by TVM with separate schedule recipes.

    cell = halstm.LSTM(input_size=512, hidden_size=512)
    f = halstm.compile(cell, steps=100, batch=64)             # CPU by default
    y, states = f(x, cell.init_parameters(seed=0))            # x: (T, B, I)

Where things live: cells and their language in ``halstm.cell``/``halstm.ops``/``halstm.cells``,
the planner in ``halstm.plan``, lowering in ``halstm.lowering``, the float64 oracle in
``halstm.oracle``, backward through time in ``halstm.autodiff`` (derivation), ``halstm.backward``
(lowering) and ``halstm.gradients`` (compiled and float64), recipes in ``halstm.schedules``
(``schedules/``), targets in ``halstm.targets`` (``targets/``), the tuner and its database in
``halstm.tuner`` and ``halstm.database``, export and runtime-only loading in ``halstm.deploy``.

Names are imported on first use, so that ``halstm.deploy`` loads modules with the TVM runtime
alone, without the compiler library that the rest needs.
"""

import importlib

_WHERE = {
    "Cell": "cell", "Params": "cell",
    "LSTM": "cells", "GRU": "cells", "PeepholeLSTM": "cells", "ResetBeforeGRU": "cells",
    "LayerNormLSTM": "cells", "LayerNormGRU": "cells",
    "MinGRU": "cells", "MinLSTM": "cells", "SRU": "cells", "RGLRU": "cells",
    "compile": "compiler", "CompiledCell": "compiler",
    "compile_backward": "gradients", "reference_backward": "gradients", "lower_backward": "backward",
    "AdjointCell": "adjoint",
    "lower": "lowering", "make_plan": "plan", "reference": "oracle",
    "matmul": "ops", "linear": "ops", "split": "ops", "sigmoid": "ops", "tanh": "ops", "exp": "ops",
    "layer_norm": "ops", "log1p": "ops", "expm1": "ops",
    "export": "deploy", "load": "deploy",
    "tune": "tuner",
}

__all__ = sorted(_WHERE)


_SUBMODULES = ("nn", "schedules", "targets")  # halstm.nn works after a plain `import halstm`


def __getattr__(name):
    if name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'halstm' has no attribute '{name}'")
    globals()[name] = value
    return value
