"""``halstm.compile``: plan, lower, schedule and build a cell for one shape, dtype and target."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm

from .cell import Cell, check_cell
from .lower import Arg, Program, lower
from .plan import make_plan

DTYPES = ("float32", "float16", "bfloat16")
ALIGNMENT = 64  # bytes: what TVM-compiled code assumes of every buffer


def compile(  # noqa: A001 (the package's verb, as tvm.compile)
    cell: Cell,
    steps: int,
    batch: int,
    dtype: str = "float32",
    target="cpu",
    recipe=None,
    knobs: dict | None = None,
) -> CompiledCell:
    """Compile ``cell`` for sequences of ``steps`` steps and ``batch`` rows.

    ``target`` is "cpu", "cuda" or a ``halstm.targets`` object; ``recipe`` a recipe (or its name)
    from ``halstm.schedules``, by default the first that applies; ``knobs`` overrides its defaults.
    """
    from halstm import schedules, targets

    check_cell(cell)
    for name, value in (("steps", steps), ("batch", batch)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    target = targets.resolve(target)
    plan = make_plan(cell)
    program = lower(cell, int(steps), int(batch), dtype, plan)
    candidates = schedules.recipes_for(program, target)
    if recipe is None:
        if not candidates:
            raise ValueError(f"no built-in recipe applies to {cell!r} on {target}")
        recipe = candidates[0]
    elif isinstance(recipe, str):
        by_name = {r.name: r for r in schedules.BUILTIN}
        if recipe not in by_name:
            raise ValueError(f"unknown recipe {recipe!r}; built-in: {sorted(by_name)}")
        recipe = by_name[recipe]
    knobs = recipe.resolve(program, target, knobs)
    layout = recipe.layout(program, target, knobs)
    if layout != program.layout:
        program = lower(cell, int(steps), int(batch), dtype, plan, layout)
    schedule = recipe.apply(program, target, **knobs)
    if schedule is None:
        raise ValueError(f"recipe '{recipe.name}' does not apply to {cell!r} on {target}")
    module = target.build(schedule.mod, **getattr(recipe, "build_options", {}))
    return CompiledCell(program, target, recipe, knobs, schedule, module)


class CompiledCell:
    """A compiled sequence function. Call it as ``y, states = f(x, params, states=None)``.

    x is (T, B, I); params a dict of the cell's parameters; states an optional dict of initial
    states (B, H) by name, zeros when absent. Returns the output sequence (T, B, H) and the final
    states by name, as NumPy arrays for NumPy inputs, or as tensors of the input's framework (torch)
    for DLPack inputs, without copies. NaN or inf in the inputs are not checked: they propagate
    through the math as in PyTorch.
    """

    def __init__(self, program: Program, target, recipe, knobs, schedule, module):
        self.program, self.target, self.recipe, self.knobs = program, target, recipe, knobs
        self.schedule, self.module = schedule, module
        self._main = module["main"]
        self._device = target.device()

    cell = property(lambda self: self.program.cell)
    plan = property(lambda self: self.program.plan)

    def __repr__(self):
        p = self.program
        return (f"<compiled {p.cell!r} T={p.steps} B={p.batch} {p.dtype} on {self.target.key} "
                f"with {self.recipe.name} {self.knobs}>")

    def __call__(self, x, params: dict, states: dict | None = None):
        p = self.program
        cell, T, B, H = p.cell, p.steps, p.batch, p.cell.hidden_size
        frame = _frame(x, self._device)
        _check(x, "x", (T, B, cell.input_size), p.dtype)
        params = _check_names(params, "params", set(cell.parameters()), required=True)
        states = _check_names(states or {}, "states", set(cell.states), required=False)
        tensors, outputs = [], {}
        for arg in p.args:
            state = arg.name[:-1]
            if arg.role == "x":
                t = frame.share(x.reshape(T * B, cell.input_size))
            elif arg.role == "param":
                _check(params[arg.name], f"params['{arg.name}']", arg.shape, arg.dtype)
                t = frame.share(params[arg.name])
            elif arg.role == "state" and state in states:
                _check(states[state], f"states['{state}']", arg.shape, arg.dtype)
                t = frame.share(states[state])
            else:
                t = _new(arg, self._device, zeros=arg.role == "state")
                outputs[arg.name] = t
            tensors.append(t)
        self._main(*tensors)
        seqs = {
            s: frame.result(outputs[f"{s}_seq"]).reshape(T + 1, B, H) for s in cell.states
        }
        return seqs[cell.output][1:], {s: v[T] for s, v in seqs.items()}


def _new(arg: Arg, device, zeros: bool):
    if zeros:
        return tvm.runtime.tensor(np.zeros(arg.shape, _numpy_dtype(arg.dtype)), device)
    return tvm.runtime.empty(arg.shape, arg.dtype, device)


def _numpy_dtype(dtype: str):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def _frame(x, device):
    if isinstance(x, np.ndarray):
        return _NumpyFrame(device)
    if type(x).__module__.startswith("torch"):
        return _TorchFrame(x, device)
    raise TypeError(f"x must be a NumPy array or a torch tensor, got {type(x).__name__}")


def _on_cpu(device) -> bool:
    return device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type()


class _NumpyFrame:
    """NumPy arrays: shared with a CPU target through DLPack where aligned, else copied (always for
    bfloat16, which DLPack exchange with NumPy does not carry)."""

    def __init__(self, device):
        self.device, self.cpu = device, _on_cpu(device)

    def share(self, value):
        value = np.ascontiguousarray(value)
        if self.cpu and value.ctypes.data % ALIGNMENT == 0 and value.dtype != ml_dtypes.bfloat16:
            return tvm.runtime.from_dlpack(value)
        return tvm.runtime.tensor(value, self.device)

    def result(self, tensor):
        return np.from_dlpack(tensor) if self.cpu and tensor.dtype != "bfloat16" else tensor.numpy()


class _TorchFrame:
    """torch tensors, shared through DLPack; they must be on the target's device."""

    def __init__(self, like, device):
        kind = "cpu" if _on_cpu(device) else "cuda"
        if like.device.type != kind:
            raise ValueError(f"x is on {like.device}, but the cell was compiled for {kind}")

    def share(self, value):
        value = value.detach().contiguous()
        if value.data_ptr() % ALIGNMENT:
            value = value.clone()
        return tvm.runtime.from_dlpack(value)

    def result(self, tensor):
        import torch

        return torch.from_dlpack(tensor)


def _dtype_of(value) -> str:
    return str(value.dtype).replace("torch.", "")


def _check(value, what: str, shape: tuple, dtype: str) -> None:
    got = tuple(int(d) for d in getattr(value, "shape", ()))
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{what}: expected an array of shape {shape}, got {type(value).__name__}")
    if len(got) != len(shape):
        raise ValueError(f"{what}: expected rank {len(shape)} with shape {shape}, got shape {got}")
    if got != tuple(shape):
        raise ValueError(f"{what}: expected shape {shape}, got {got} (compiled for this shape)")
    if _dtype_of(value) != dtype:
        raise TypeError(f"{what}: expected dtype {dtype}, got {_dtype_of(value)}")


def _check_names(values, what: str, names: set, required: bool) -> dict:
    if not isinstance(values, dict):
        raise TypeError(f"{what} must be a dict by name, got {type(values).__name__}")
    extra = set(values) - names
    missing = names - set(values) if required else set()
    if extra or missing:
        parts = ([f"missing {sorted(missing)}"] if missing else []) + ([f"unexpected {sorted(extra)}"] if extra else [])
        raise KeyError(f"{what}: {', '.join(parts)}; expected {sorted(names)}")
    return values
