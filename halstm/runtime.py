"""Calling a compiled sequence function: its signature (``Arg``, ``Signature``), the call
(``SequenceFunction``: arguments checked and bound in order, results), through the frames of
``halstm.frames``.

Needs only NumPy and the TVM runtime, so a module exported by ``halstm.deploy`` loads and runs
where the TVM compiler library is absent (``TVM_USE_RUNTIME_LIB=1``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass

from .frames import Pack, ScratchPools, as_frame, check_array, check_names, on_cpu

STEPS = "n_steps"  # the argument that is T, in a function for any sequence length


@dataclass(frozen=True)
class Arg:
    """One argument of the lowered function, in call order."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # "x", "state", "param", "output", "scratch" (``halstm.scratch``), or "steps": T, where
    # the function serves any
    # a sequence of a function for any T: ``shape[0]`` rows a step, over T + extra_steps steps
    extra_steps: int | None = None

    @classmethod
    def sequence(cls, name: str, steps: int | None, batch: int, extra_steps: int, cols: int, dtype: str,
                 role: str) -> Arg:
        """A buffer of ``batch`` rows a step over ``steps`` + ``extra_steps`` steps (any T where
        ``steps`` is None)."""
        if steps is None:
            return cls(name, (batch, cols), dtype, role, extra_steps)
        return cls(name, ((steps + extra_steps) * batch, cols), dtype, role)

    def at(self, steps: int) -> Arg:
        """The argument of a call over ``steps`` steps, its shape concrete."""
        if self.extra_steps is not None:
            rows = (steps + self.extra_steps) * self.shape[0]
            return Arg(self.name, (rows, *self.shape[1:]), self.dtype, self.role)
        if all(type(d) is int for d in self.shape):
            return self
        return Arg(self.name, tuple(dimension(d, steps) for d in self.shape), self.dtype, self.role)

    @classmethod
    def from_json(cls, d: dict) -> Arg:
        return cls(d["name"], tuple(_from_json_dim(x) for x in d["shape"]), d["dtype"], d["role"], d.get("extra_steps"))


# a dimension that follows T (``halstm.scratch``): "T", an int, or (operator, left, right)
DIM_OPERATORS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "//": int.__floordiv__, "%": int.__mod__,
                 "min": min, "max": max}


def dimension(dim, steps: int) -> int:
    """``dim`` (an int, or an expression of T) at T = ``steps``."""
    if type(dim) is int:
        return dim
    if dim == "T":
        return steps
    op, left, right = dim
    return DIM_OPERATORS[op](dimension(left, steps), dimension(right, steps))


def check_dimension(dim, follows_steps: bool, depth: int = 16) -> None:
    """Refuse a dimension (a sidecar's, before a call evaluates it) that is neither a positive int
    (a non-negative one) nor, where ``follows_steps``, an expression of T over DIM_OPERATORS, at most ``depth`` deep."""
    if type(dim) is int:
        if dim < 0:
            raise ValueError(f"a negative dimension {dim}")
        return
    if follows_steps and dim == "T":
        return
    if not follows_steps or not isinstance(dim, tuple) or len(dim) != 3 or dim[0] not in DIM_OPERATORS or depth == 0:
        raise ValueError(f"expected {'an int or an expression of T' if follows_steps else 'an int'}, found {dim!r}")
    check_dimension(dim[1], True, depth - 1)
    check_dimension(dim[2], True, depth - 1)


def _from_json_dim(dim):
    return tuple(_from_json_dim(d) for d in dim) if isinstance(dim, list) else dim


@dataclass(frozen=True)
class Signature:
    """Everything a call needs to know about the compiled function (an export's sidecar keeps it)."""

    cell: str
    states: tuple[str, ...]
    output: str
    input_size: int
    hidden_size: int
    steps: int
    batch: int
    dtype: str
    args: tuple[Arg, ...]
    longest: int | None = None  # where ``steps`` is None (any T): the longest sequence it takes

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Signature:
        args = tuple(Arg.from_json(a) for a in d["args"])
        return cls(**{**d, "states": tuple(d["states"]), "args": args})

    def __str__(self):
        return json.dumps(self.to_json())


class SequenceFunction:
    """A compiled sequence function. Call it as ``y, states = f(x, params, states=None)``.

    x is (T, B, I); params a dict of the cell's parameters; states an optional dict of initial
    states (B, H) by name, zeros when absent. Returns the output sequence (T, B, H) and the final
    states by name, as NumPy arrays for NumPy inputs, or as torch tensors for torch inputs (shared
    through DLPack, no copies). NaN or inf in the inputs are not checked: they propagate through
    the math as in PyTorch.
    """

    PLANS_KEPT = 64  # call plans kept for a function of any T, one a sequence length

    def __init__(self, main, signature: Signature, device):
        self._main, self.signature, self._device = main, signature, device
        self._param_names = {a.name for a in signature.args if a.role == "param"}
        self._state_names = set(signature.states)
        self._cpu = on_cpu(device)
        given = [a for a in signature.args if a.role != "scratch"]
        self.scratch = tuple(signature.args[len(given):])  # ``halstm.scratch``: the last arguments
        if any(a.role != "scratch" for a in self.scratch):
            raise ValueError("a compiled function's scratch buffers must be its last arguments")
        # per argument but scratch, in call order: (arg, where a given value is: "params" or "states" or None, its key)
        self._slots = [(a, {"param": "params", "state": "states"}.get(a.role),
                        a.name[:-1] if a.role == "state" else a.name) for a in given]
        self._plans: dict[int, tuple] = {}

    @property
    def slots(self) -> list:
        """Per argument of the compiled function but its scratch buffers (``scratch``, which come
        after), in call order: (its ``Arg``, where a caller's value comes from: "params", "states"
        or None, its key there)."""
        return self._slots

    def _plan_for(self, steps: int) -> tuple[list, Pack]:
        """A call over ``steps`` steps worked out once (the most recent ``PLANS_KEPT`` kept): per
        argument but scratch, its ``slots`` entry with the ``Arg`` at ``steps`` and the argument's
        name in errors; the scratch buffers, allocated together."""
        plan = self._plans.get(steps)
        if plan is None:
            if len(self._plans) >= self.PLANS_KEPT:
                self._plans.pop(next(iter(self._plans)))
            args = [(a.at(steps), where, key, f"{where}['{key}']") for a, where, key in self._slots]
            plan = self._plans[steps] = (args, Pack(a.at(steps) for a in self.scratch))
        return plan

    @property
    def function(self):
        """The compiled function itself, called with every argument in order."""
        return self._main

    def __call__(self, x, params: dict, states: dict | None = None):
        seqs = self.sequences(x, params, states)
        return seqs[self.signature.output][1:], {s: v[-1] for s, v in seqs.items()}

    def sequences(self, x, params: dict, states: dict | None = None) -> dict:
        """Every state at every step: (T + 1, B, H) by name, the initial state first."""
        run, finish, frame = self._bind(x, params, states, reuse=True)
        run()
        done = finish()
        frame.release()
        return done

    def sequences_keeping(self, x, params: dict, states: dict | None, names) -> tuple[dict, dict]:
        """``sequences``, and the scratch buffers ``names`` by name as the call left them (the hoisted
        GEMMs' results, which ``compile_backward(..., given_hoisted=True)`` reads), each the call's own."""
        unknown = set(names) - {a.name for a in self.scratch}
        if unknown:
            raise ValueError(f"no scratch buffer {sorted(unknown)} to keep: this function's are "
                             f"{[a.name for a in self.scratch]}")
        run, finish, frame = self._bind(x, params, states)
        run()
        kept = {a.name: t for a, t in zip(self.scratch, finish.scratch) if a.name in names}
        return finish(), {n: frame.result(kept[n]) for n in names}

    def prepare(self, x, params: dict, states: dict | None = None):
        """Check and convert the arguments once; returns a function that runs the kernel and waits
        for the device, as benchmarks and the tuner time it."""
        run, _, frame = self._bind(x, params, states)

        def timed():
            run()
            frame.sync()

        return timed

    @functools.cached_property
    def _scratch_pools(self) -> ScratchPools:
        return ScratchPools()

    def _bind(self, x, params: dict, states: dict | None, reuse: bool = False):
        """The call with its arguments checked and bound in order (outputs allocated), the function
        that returns the state sequences after it (its ``scratch``: the scratch buffers in order), and
        the frame. With ``reuse``, the scratch buffers are one of ``_scratch_pools``' allocations
        (torch tensors), which ``frame.release()`` gives back. A call's host time beyond the
        prepared call, torch tensors, LSTM T=2 B=2 H=8 on the 2-core CPU machine (``python
        benchmarks/call_overhead.py LSTM 2,2,8 float32 --device cpu --reps 5000``, three runs): 21.2-21.9
        us, 28.1-28.5 before the argument plan (``_slots``), the cached dtype names and the shares that
        make no new tensor objects."""
        sig = self.signature
        T = sig.steps or steps_of(x, sig.batch, sig.input_size, sig.dtype, sig.longest)
        B, H = sig.batch, sig.hidden_size
        frame = as_frame(x, self._device, self._cpu)
        check_array(x, "x", (T, B, sig.input_size), sig.dtype)
        params = check_names(params, "params", self._param_names, required=True)
        states = check_names(states or {}, "states", self._state_names, required=False)
        args, pack = self._plan_for(T)
        tensors, outputs = [], {}
        given = {"params": params, "states": states}
        for arg, where, key, what in args:
            if arg.role == "steps":
                t = T
            elif arg.role == "x":
                t = frame.share(x.reshape(arg.shape))
            elif where is not None and key in given[where]:
                value = given[where][key]
                check_array(value, what, arg.shape, arg.dtype)
                t = frame.share(value)
            else:
                t = frame.new(arg, zeros=arg.role == "state")
                outputs[arg.name] = t
            tensors.append(t)
        scratch = frame.new_all(pack, reuse=self._scratch_pools.of(frame) if reuse else None)
        tensors += scratch

        def finish():
            return {s: frame.result(outputs[s + "_seq"]).reshape(T + 1, B, H) for s in sig.states}

        finish.scratch = scratch

        return frame.on_device(functools.partial(self._main, *tensors)), finish, frame


def steps_of(x, batch: int, input_size: int, dtype: str, longest: int) -> int:
    """T of a call to a function that serves any: x's first dimension, checked against the longest
    sequence the function takes."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 3:
        check_array(x, "x", ("T", batch, input_size), dtype)  # raises, naming what x is
    T = int(shape[0])
    if not 1 <= T <= longest:
        raise ValueError(f"x: {T} steps; this function takes 1 to {longest} (its buffers are indexed with "
                         f"int32): use shorter calls, each starting from the last one's final states")
    return T
