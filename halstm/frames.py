"""How a call's arrays reach a compiled function: NumPy arrays and torch tensors shared through
DLPack or copied (the frames), outputs and scratch buffers allocated (``Pack``, one allocation a
call, reused through ``ScratchPool``), and the arguments' checks.

Needs only NumPy and the TVM runtime (torch is imported where a torch tensor is given), as
``runtime`` does."""

from __future__ import annotations

import functools
import itertools
import math
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np
import tvm

if TYPE_CHECKING:
    from .runtime import Arg

ALIGNMENT = 64  # bytes: what TVM-compiled code assumes of every buffer


class ScratchPool:
    """Allocations of scratch buffers that the calls of one compiled function take in turn
    (``TorchFrame.new_all``), with the views the last call laid out in one (``views``). On the CPU,
    torch's allocator returns a large block to the system when it is freed, and each call's first
    writes into a new one fault its pages in again (``halstm.nn.LSTM`` float32 training steps on the
    2-core CPU machine, the backward's pack reused: (100,16,512) 215 -> 191 ms, (100,64,512) 763 ->
    682 ms). On a GPU a call saves the allocation and the views of each buffer (LSTM fp16
    (100,16,512)'s backward, H200, ``benchmarks/call_overhead.py LSTM 100,16,512 float16 --device cuda
    --backward``, alternating twice: 116-251 us a call beyond its kernels, 78-80 pooled); an
    allocation is given back as soon as the call has launched its kernels, so a pool serves one CUDA
    stream, whose next call runs after them (``ScratchPools``). At most ``KEPT`` are kept (calls
    from several threads take one each)."""

    KEPT = 2

    def __init__(self):
        self._free: list = []
        self._laid_out = None  # (allocation, pack, its buffers) of the last call

    def take(self, nbytes: int):
        """An allocation of at least ``nbytes`` bytes, or None (those too small are dropped)."""
        while True:
            try:
                flat = self._free.pop()  # atomic: threads never take the same one
            except IndexError:
                return None
            if flat.numel() >= nbytes:
                return flat

    def give(self, flat) -> None:
        if len(self._free) < self.KEPT:
            self._free.append(flat)

    def views(self, flat, pack: Pack, lay_out) -> list:
        """``pack``'s buffers in ``flat`` (``lay_out(flat, pack)``), laid out again only where the last
        call laid out others."""
        last = self._laid_out
        if last is None or last[0] is not flat or last[1] is not pack:
            last = self._laid_out = (flat, pack, lay_out(flat, pack))
        return last[2]


class ScratchPools:
    """A compiled function's ``ScratchPool``s, one for the host and one a CUDA stream its calls ran
    on (``TorchFrame.pool_key``); none for a call made while a CUDA graph is captured (its buffers
    then belong to the graph) or with NumPy arrays (TVM allocates those a call)."""

    def __init__(self):
        self._pools: dict = {}

    def of(self, frame) -> ScratchPool | None:
        key = frame.pool_key()
        if key is None:
            return None
        pool = self._pools.get(key)
        return pool if pool is not None else self._pools.setdefault(key, ScratchPool())


class Pack:
    """Buffers allocated together (``new_all`` of a frame): each at an ALIGNMENT-aligned byte offset
    of one allocation, ``nbytes`` in all; ``ends[i]``: the bytes that the first i + 1 reach.

    ``phases`` (one a buffer; None: all None) lets buffers share bytes: a buffer with a phase is used
    only while that phase runs (one function's own scratch, the functions called one after another on
    one stream). The buffers without one come first; after them, a region as large as the largest
    phase's buffers together, where each phase lays out its own from the region's start."""

    def __init__(self, args, phases=None):
        self.args = tuple(args)
        phases = [None] * len(self.args) if phases is None else list(phases)
        sizes = [-(-math.prod(a.shape) * np.dtype(numpy_dtype(a.dtype)).itemsize // ALIGNMENT) * ALIGNMENT
                 for a in self.args]
        self.offsets, shared = [0] * len(self.args), 0
        for i, phase in enumerate(phases):
            if phase is None:
                self.offsets[i], shared = shared, shared + sizes[i]
        used: dict = {}
        for i, phase in enumerate(phases):
            if phase is not None:
                self.offsets[i] = shared + used.get(phase, 0)
                used[phase] = used.get(phase, 0) + sizes[i]
        self.nbytes = shared + max(used.values(), default=0)
        self.ends = list(itertools.accumulate((o + n for o, n in zip(self.offsets, sizes)), max))

    @functools.cached_property
    def torch_views(self) -> list[tuple]:
        """Per buffer: its torch dtype, shape, contiguous strides, byte offset and element size."""
        import torch

        views = []
        for a, offset in zip(self.args, self.offsets):
            strides = [1] * len(a.shape)
            for i in reversed(range(len(a.shape) - 1)):
                strides[i] = strides[i + 1] * a.shape[i + 1]
            views.append((getattr(torch, a.dtype), a.shape, tuple(strides), offset, np.dtype(numpy_dtype(a.dtype)).itemsize))
        return views


def new_array(arg: Arg, device, zeros: bool):
    if zeros:
        return tvm.runtime.tensor(np.zeros(arg.shape, numpy_dtype(arg.dtype)), device)
    return tvm.runtime.empty(arg.shape, arg.dtype, device)


def numpy_dtype(dtype: str):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def as_frame(x, device, cpu: bool | None = None):
    """The exchange for x's kind of array; ``cpu``: whether ``device`` is the host (asked when None:
    a compiled function knows it once)."""
    cpu = on_cpu(device) if cpu is None else cpu
    if isinstance(x, np.ndarray):
        return _NumpyFrame(device, cpu)
    if type(x).__module__.startswith("torch"):
        return TorchFrame(x, device, cpu)
    raise TypeError(f"x must be a NumPy array or a torch tensor, got {type(x).__name__}")


def on_cpu(device) -> bool:
    return device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type()


class _NumpyFrame:
    """NumPy arrays: shared with a CPU target through DLPack where aligned, else copied (always for
    bfloat16, which DLPack exchange with NumPy does not carry)."""

    def __init__(self, device, cpu: bool):
        self.device, self.cpu = device, cpu

    def share(self, value):
        value = np.ascontiguousarray(value)
        if self.cpu and value.ctypes.data % ALIGNMENT == 0 and value.dtype != ml_dtypes.bfloat16:
            return tvm.runtime.from_dlpack(value)
        return tvm.runtime.tensor(value, self.device)

    def new(self, arg: Arg, zeros: bool):
        return new_array(arg, self.device, zeros)

    def new_all(self, pack: Pack, zeros: int = 0, reuse: ScratchPool | None = None) -> list:
        return [new_array(a, self.device, i < zeros) for i, a in enumerate(pack.args)]

    def release(self) -> None:
        pass

    def pool_key(self):
        """None: NumPy arrays' scratch buffers are allocated a call (``new_all``)."""
        return None

    def result(self, tensor):
        return np.from_dlpack(tensor) if self.cpu and tensor.dtype != "bfloat16" else tensor.numpy()

    def on_device(self, call):
        return call

    def sync(self) -> None:
        self.device.sync()


class TorchFrame:
    """torch tensors, passed to the compiled function as they are: tvm_ffi converts them (DLPack,
    no copies) and launches the kernels on torch's current CUDA stream, ordered with the torch work
    around them. They must be on the target's device. Results are allocated by torch (its caching
    allocator): TVM's own allocation is a cudaMalloc and cudaFree a call, which cost 0.1-0.3 ms a
    call on an H100 (T=100, B=16, H=512: 0.87 ms a call, 0.59 ms with the arguments bound once;
    docs/results.md#call-overhead). A call cost 88-92 us beyond its kernels there (benchmarks/call_overhead.py,
    LSTM fp16 B=16 H=512 and B=64 H=1024) when each tensor was wrapped in Python: cProfile's top
    entries were torch.cuda.current_stream (three a call: tvm_ffi.use_torch_stream, torch.from_dlpack
    of each result), torch.from_dlpack and tvm.runtime.from_dlpack."""

    def __init__(self, like, device, cpu: bool):
        kind = "cpu" if cpu else "cuda"
        if like.device.type != kind:
            raise ValueError(f"x is on {like.device}, but the cell was compiled for {kind}")
        self.torch_device = like.device

    def new(self, arg: Arg, zeros: bool):
        import torch

        make = torch.zeros if zeros else torch.empty
        return make(arg.shape, dtype=getattr(torch, arg.dtype), device=self.torch_device)

    def new_all(self, pack: Pack, zeros: int = 0, reuse: ScratchPool | None = None) -> list:
        """The pack's buffers, the first ``zeros`` of them zeros (one fill) and the rest uninitialised:
        views of one torch allocation (one call to the caching allocator, and one free when the last
        of them goes); with ``reuse``, one of its allocations where it has one large enough, given
        back by ``release`` (the caller's, once the call is done with every buffer), and the views
        the last call made of it."""
        import torch

        if not pack.args:
            return []
        flat = reuse.take(pack.nbytes + ALIGNMENT) if reuse is not None else None
        if flat is None:
            flat = torch.empty(pack.nbytes + ALIGNMENT, dtype=torch.uint8, device=self.torch_device)
        if reuse is None:
            views = _lay_out(flat, pack)
        else:
            self._lent = (reuse, flat)
            views = reuse.views(flat, pack, _lay_out)
        if zeros:
            start = -flat.data_ptr() % ALIGNMENT
            flat[start:start + pack.ends[zeros - 1]].zero_()
        return views

    def pool_key(self):
        """Which ``ScratchPool`` a call's scratch buffers come from: the host's, or on a GPU the current
        CUDA stream's, whose next call runs after this one's kernels; None while a CUDA graph is
        captured on it, and for tensors on a GPU other than the current one."""
        import torch

        device = self.torch_device
        if device.type != "cuda":
            return "cpu"
        if device.index != torch.cuda.current_device() or torch.cuda.is_current_stream_capturing():
            return None
        return device.index, torch.cuda.current_stream(device).cuda_stream

    def release(self) -> None:
        """The allocation ``new_all`` took from its ``reuse``, given back."""
        lent = self.__dict__.pop("_lent", None)
        if lent is not None:
            lent[0].give(lent[1])

    def share(self, value):
        if value.requires_grad:
            value = value.detach()
        if not value.is_contiguous():
            value = value.contiguous()
        return value.clone() if value.data_ptr() % ALIGNMENT else value

    def result(self, tensor):
        return tensor

    def on_device(self, call):
        """``call`` run with the tensors' GPU as torch's current device where it is not already:
        a kernel launch makes its tensors' device CUDA's current one and leaves it so (and torch's
        current stream, which the launch uses, is the current device's); ``torch.cuda.device``
        puts the caller's back."""
        import torch

        device = self.torch_device
        if device.type != "cuda" or device.index == torch.cuda.current_device():
            return call

        def on_its_device():
            with torch.cuda.device(device):
                return call()

        return on_its_device

    def sync(self) -> None:
        """Wait for the tensors' device."""
        import torch

        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)


def _lay_out(flat, pack: Pack) -> list:
    """``pack``'s buffers as views of ``flat`` (a torch allocation of at least ``pack.nbytes`` +
    ALIGNMENT bytes), from its first ALIGNMENT-aligned byte."""
    start, typed, views = -flat.data_ptr() % ALIGNMENT, {}, []
    for dtype, shape, strides, offset, size in pack.torch_views:
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = flat.view(dtype)
        views.append(whole.as_strided(shape, strides, (start + offset) // size))
    return views


def _dtype_of(value) -> str:
    return _dtype_name(value.dtype)


@functools.cache
def _dtype_name(dtype) -> str:
    """NumPy's or torch's dtype by TVM's name: torch.float16 -> float16."""
    return str(dtype).replace("torch.", "")


def check_array(value, what: str, shape: tuple, dtype: str) -> None:
    if getattr(value, "shape", None) == shape and hasattr(value, "dtype") and _dtype_of(value) == dtype:
        return  # the common case, first: it is on every call's path
    got = tuple(int(d) for d in getattr(value, "shape", ()))
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{what}: expected an array of shape {shape}, got {type(value).__name__}")
    if len(got) != len(shape):
        raise ValueError(f"{what}: expected rank {len(shape)} with shape {shape}, got shape {got}")
    if got != tuple(shape):
        raise ValueError(f"{what}: expected shape {shape}, got {got} (compiled for this shape)")
    if _dtype_of(value) != dtype:
        raise TypeError(f"{what}: expected dtype {dtype}, got {_dtype_of(value)}")


def check_names(values, what: str, names: set, required: bool) -> dict:
    if isinstance(values, dict) and (values.keys() == names if required else values.keys() <= names):
        return values  # the common case, first: it is on every call's path
    if not isinstance(values, dict):
        raise TypeError(f"{what} must be a dict by name, got {type(values).__name__}")
    extra = set(values) - names
    missing = names - set(values) if required else set()
    if extra or missing:
        parts = ([f"missing {sorted(missing)}"] if missing else []) + ([f"unexpected {sorted(extra)}"] if extra else [])
        raise KeyError(f"{what}: {', '.join(parts)}; expected {sorted(names)}")
    return values
