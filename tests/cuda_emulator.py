"""A CUDA kernel's TVMScript run in Python, one emulated thread at a time, in float64: ``T`` stands
for TVMScript's namespace (math, casts, blocks, the WMMA calls), ``Buffer`` for a buffer whose every
access ``Memory`` records to find races between threads (``Race``). Used by the persistent kernel's
tests (its step text, phase by phase), the weight-packing tests and ``run_kernel`` (TVM's lowered
kernels)."""

import ast
import contextlib
import itertools
import math

import numpy as np
import tvm
import tvm_ffi


class Race(AssertionError):
    pass


class Memory:
    """Every buffer access of an emulated launch, to find races: within a phase between two
    __syncthreads, an address one thread wrote and another thread of the block read or wrote (with
    another value); in global memory, the same between blocks anywhere between two grid syncs."""

    def __init__(self):
        self.who, self.phase, self.interval = (0, 0), 0, 0
        # (epoch, buffer, index) -> (its readers {(thread, phase)}, its writes {(thread, phase, value)})
        self.seen = {}

    def access(self, name, key, shared, value=None, polled=False):
        """Record one access; ``polled``: a read that waits for its value (it cannot race), not recorded.
        Two reads never race, so a read is checked against the address's writes alone (an address
        that every thread reads, as a weight, is checked against its one write, not every read)."""
        if polled:
            return
        epoch = (self.phase, self.who[0]) if shared else self.interval
        reads, writes = self.seen.setdefault((epoch, name, key), (set(), set()))
        for other, phase, wrote in writes if value is None else itertools.chain(
                ((o, p, None) for o, p in reads), writes):
            if other == self.who or (other[0] == self.who[0] and phase != self.phase):
                continue  # the same thread, or the same block across a __syncthreads
            if value is not None and value == wrote:
                continue  # the same value written twice
            raise Race(f"{name}{list(key)}: thread {self.who} and thread {other}")
        if value is None:
            reads.add((self.who, self.phase))
        else:
            writes.add((self.who, self.phase, value))


class Ramp(tuple):
    """The element indices of a vector access, ``T.Ramp(base, stride, lanes)``."""

    @classmethod
    def of(cls, base, stride, lanes):
        return cls(base + i * stride for i in range(lanes))


def broadcast(value, lanes):
    """``T.Broadcast(value, lanes)``."""
    return np.full(lanes, value)


class Buffer:
    def __init__(self, name, array, memory, shared=False, row=0, tags=None):
        self.name, self.array, self.memory, self.shared, self.row = name, array, memory, shared, row
        self.tags = {} if tags is None else tags  # the step tag of each element written tagged

    def _key(self, idx):
        key = idx if isinstance(idx, tuple) else (idx,)
        key = (key[0] + self.row, *key[1:])
        assert all(0 <= i < n for i, n in zip(key, self.array.shape)), f"{self.name}{list(key)} out of {self.array.shape}"
        return key

    def __getitem__(self, idx):
        if isinstance(idx, slice) and self.array.ndim == 1:  # a vector load, as TVMScript prints it
            idx = Ramp(range(idx.start, idx.stop))
        if isinstance(idx, Ramp):  # a vector load
            return np.array([self[i] for i in idx])
        if any(isinstance(i, slice) for i in (idx if isinstance(idx, tuple) else (idx,))):  # T.reads' region
            return None
        key = self._key(idx)
        self.memory.access(self.name, key, self.shared)
        return self.array[key]

    def __setitem__(self, idx, value):
        if isinstance(idx, slice) and self.array.ndim == 1:  # a vector store, as TVMScript prints it
            idx = Ramp(range(idx.start, idx.stop))
        if isinstance(idx, Ramp):  # a vector store
            for i, v in zip(idx, np.broadcast_to(value, len(idx))):
                self[i] = v
            return
        key = self._key(idx)
        self.memory.access(self.name, key, self.shared, float(value))
        self.array[key] = value

    def view(self, row):
        return Buffer(self.name, self.array, self.memory, self.shared, row, self.tags)

    def flat_key(self, offset):
        """The index of flat element ``offset`` (row-major) of this buffer or view."""
        return divmod(offset, self.array.shape[1]) if self.array.ndim == 2 else offset

    def poll(self, offset):
        """The element a polling read returns: it waits until the value is no longer the sentinel
        (NaN here), which in an emulation that runs phase by phase means it must be written by now."""
        key = self._key(self.flat_key(offset))
        self.memory.access(self.name, key, self.shared, polled=True)
        if math.isnan(self.array[key]):
            raise Race(f"{self.name}{list(key)} polled before anyone wrote it (the kernel would wait forever)")
        return self.array[key]

    def store_tagged(self, offset, tag, value):
        """A value written with the step it belongs to (``halstm_store_part``)."""
        key = self._key(self.flat_key(offset))
        self.memory.access(self.name, key, self.shared, float(value))
        self.array[key], self.tags[key] = value, tag

    def poll_tagged(self, offset, tag):
        """The value a read waiting for ``tag`` returns (``halstm_poll_parts``): in an emulation that
        runs phase by phase, it must carry that tag by now."""
        key = self._key(self.flat_key(offset))
        self.memory.access(self.name, key, self.shared, polled=True)
        if self.tags.get(key) != tag:
            raise Race(f"{self.name}{list(key)} polled for tag {tag} holds tag {self.tags.get(key)} "
                       "(the kernel would wait forever)")
        return self.array[key]

    def access_ptr(self, mask, ptr_type=None, offset=0):
        return self, offset


class Fragment:
    """WMMA fragments: 16 x 16 tiles, as many as the allocation holds (each lane of the warp holds
    the whole tile here)."""

    def __init__(self, shape, *_, **__):
        self.tiles = np.full((shape[0] // 256, 16, 16), np.nan)

    @property
    def data(self):
        return self

    def __getitem__(self, region):
        """A region in T.reads/T.writes (fragments held across the steps: resident weights)."""
        return self


def tile(pointer, ldm, layout):
    """The 16 x 16 tile a WMMA load reads or a store writes: (buffer, index of (r, c), r, c); a flat
    offset into a 2-D buffer (a state in global memory) becomes (row, column)."""
    buffer, offset = pointer
    at = (lambda r, c: offset + r * ldm + c) if layout == "row_major" else (lambda r, c: offset + c * ldm + r)
    return [(buffer, buffer.flat_key(at(r, c)), r, c) for r in range(16) for c in range(16)]


class T:
    """What the step's TVMScript calls, in float64."""

    min, max, unroll, vectorized = min, max, range, range
    float32 = float
    uint16 = uint32 = uint64 = int

    @staticmethod
    def reinterpret(dtype, bits):
        """Only the polled states' sentinel (schedules/persistent_kernel.py) is reinterpreted: NaN."""
        return math.nan

    @staticmethod
    def call_extern(dtype, name, *args):
        """The device helpers of targets/cuda.py that kernels call."""
        if name == "halstm_not_sentinel":
            return args[0]
        if name == "halstm_store_part":
            (buffer, offset), tag, value = args
            return buffer.store_tagged(offset, tag, value)
        if name == "halstm_poll_parts":
            tag, pointers = args[0], args[1:]
            for (dst, at), (src, offset) in zip(pointers[::2], pointers[1::2]):
                dst[dst.flat_key(at)] = src.poll_tagged(offset, tag)
            return None
        if name.startswith("halstm_wait_value<"):
            (src, offset), = args[1:]
            if args[0]:
                src.poll(offset)
            return None
        assert name.startswith("halstm_poll_stage<"), name
        size, word = map(int, name[name.index("<") + 1:-1].split(","))
        poll, pointers = args[0], args[1:]
        for (dst, at), (src, offset) in zip(pointers[::2], pointers[1::2]):
            for e in range(size // word):
                value = src.poll(offset + e) if poll else src[src.flat_key(offset + e)]
                dst[dst.flat_key(at + e)] = value
    tanh, exp, sqrt, log = math.tanh, math.exp, math.sqrt, math.log

    @staticmethod
    def Cast(dtype, x):
        return x

    @staticmethod
    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    @staticmethod
    def rsqrt(x):
        return 1 / math.sqrt(x)

    # the tensor-core GEMM's block and WMMA calls (warp-wide: every lane does the whole tile here)
    sblock_alloc_buffer = Fragment

    @staticmethod
    def sblock(name):
        return contextlib.nullcontext()

    @staticmethod
    def reads(*regions):
        pass

    writes = evaluate = reads

    @staticmethod
    def tvm_fill_fragment(frag, m, n, k, index, value, dtype=None):
        frag.tiles[index] = value

    @staticmethod
    def tvm_load_matrix_sync(frag, m, n, k, index, pointer, ldm, layout, dtype=None):
        for buffer, i, r, c in tile(pointer, ldm, layout):
            frag.tiles[index, r, c] = buffer[i]

    @staticmethod
    def tvm_mma_sync(d, di, a, ai, b, bi, c, ci, dtype=None):
        d.tiles[di] = a.tiles[ai] @ b.tiles[bi] + c.tiles[ci]

    @staticmethod
    def tvm_store_matrix_sync(frag, m, n, k, index, pointer, ldm, layout, dtype=None):
        for buffer, i, r, c in tile(pointer, ldm, layout):
            buffer[i] = frag.tiles[index, r, c]


class LazyIfThenElse(ast.NodeTransformer):
    """T.if_then_else(c, a, b) as (a if c else b): as in TIR and CUDA, the arm not taken is not read (a
    stacked weight's read at n minus the first weight's rows: out of bounds)."""

    def visit_Call(self, node):
        self.generic_visit(node)
        return ast.IfExp(*node.args) if ast.unparse(node.func) == "T.if_then_else" else node


def compile_text(source: str, name: str):
    """TVMScript statements compiled to run as Python, ``T.if_then_else`` lazily (``LazyIfThenElse``)."""
    return compile(ast.fix_missing_locations(LazyIfThenElse().visit(ast.parse(source))), name, "exec")


# --- TensorIR as Python ------------------------------------------------------------------------
_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "FloorDiv": "//", "FloorMod": "%", "Div": "/", "LT": "<",
           "LE": "<=", "GT": ">", "GE": ">=", "EQ": "==", "NE": "!=", "And": "and", "Or": "or"}
_ACCESS = {1: "r", 2: "w", 3: "rw"}


def identifier(name: str) -> str:
    """A TIR name as a Python name: lowered kernels name their threads blockIdx.x, rfactor its
    buffers x.rf."""
    return name.replace(".", "_")


def python_expr(e) -> str:
    """A TensorIR expression as Python over the names of ``T`` and of the buffers and variables."""
    kind = type(e).__name__
    if kind in ("IntImm", "FloatImm"):
        return repr(e.value)
    if kind == "StringImm":
        return repr(e.value)
    if kind == "Var":
        return "0" if e.name == "elem_offset" else identifier(e.name)  # a view's offset: views are rows of their buffer here
    if kind in _BINARY:
        return f"({python_expr(e.a)} {_BINARY[kind]} {python_expr(e.b)})"
    if kind in ("Min", "Max"):
        return f"{kind.lower()}({python_expr(e.a)}, {python_expr(e.b)})"
    if kind == "Not":
        return f"(not {python_expr(e.a)})"
    if kind == "Cast":
        return f'T.Cast("{e.ty}", {python_expr(e.value)})'
    if kind == "Select":
        return f"({python_expr(e.true_value)} if {python_expr(e.condition)} else {python_expr(e.false_value)})"
    if kind == "TensorLoad":
        return f"{identifier(e.source.name)}[{', '.join(map(python_expr, e.indices))}]"
    if kind == "Call":
        op, args = e.op.name, list(e.args)
        if op == "prim.if_then_else":  # lazily: the arm not taken is not read, as in TIR and CUDA
            return f"({python_expr(args[1])} if {python_expr(args[0])} else {python_expr(args[2])})"
        if op == "tirx.buffer_data":
            return identifier(args[0].name)
        if op == "tirx.tvm_access_ptr":
            return f'{python_expr(args[1])}.access_ptr("{_ACCESS[args[4].value]}", offset={python_expr(args[2])})'
        if op == "tirx.call_extern" and args[0].value == "halstm_lane_sum":  # the warp's lanes in step: ``lockstep``
            return f"(yield ({python_expr(args[1])}, {python_expr(args[2])}))"
        typed = [f'"{e.ty}"'] if op in ("tirx.call_extern", "tirx.reinterpret") else []
        return f"T.{op.split('.')[-1]}({', '.join(typed + [python_expr(a) for a in args])})"
    raise NotImplementedError(f"the emulator cannot run {kind}: {e}")


def python_lines(stmt) -> list[str]:
    """A TensorIR statement as Python lines (``python_expr``); a block's own buffers (WMMA
    fragments) allocated where it starts, its declared reads and writes left out; in a lowered
    kernel, a __syncthreads as ``yield`` (``run_kernel``), the buffers' declarations left out."""
    kind = type(stmt).__name__
    if kind == "AttrStmt":  # a thread's launch, a reduction's scope
        return python_lines(stmt.body)
    if kind in ("DeclBuffer", "AllocBuffer"):
        return []
    if kind == "Evaluate" and _is_call(stmt.value, "tirx.tvm_storage_sync"):
        return ["yield"]
    if kind == "SeqStmt":
        return [line for s in stmt.seq for line in python_lines(s)]
    if kind == "For":
        body = python_lines(stmt.body)
        return [f"for {identifier(stmt.loop_var.name)} in range({python_expr(stmt.min)}, {python_expr(stmt.min + stmt.extent)}):",
                *("    " + line for line in body)]
    if kind == "IfThenElse":
        out = [f"if {python_expr(stmt.condition)}:", *("    " + line for line in python_lines(stmt.then_case))]
        if stmt.else_case is not None:
            out += ["else:", *("    " + line for line in python_lines(stmt.else_case))]
        return out
    if kind == "BufferStore":
        return [f"{identifier(stmt.buffer.name)}[{', '.join(map(python_expr, stmt.indices))}] = {python_expr(stmt.value)}"]
    if kind == "Evaluate":
        return [python_expr(stmt.value)]
    if kind == "SBlockRealize":
        block = stmt.block
        allocs = [f"{identifier(b.name)} = T.sblock_alloc_buffer(({', '.join(map(python_expr, b.shape))},))"
                  for b in block.alloc_buffers]
        return allocs + python_lines(block.body)
    raise NotImplementedError(f"the emulator cannot run {kind}")


def lockstep(threads: list, memory: Memory) -> list:
    """Run a block's threads (``(tx, generator)``, in thread order) on to their next ``yield``: a
    __syncthreads (``yield`` alone), or a sum over an aligned group of L lanes (``halstm_lane_sum``:
    ``yield (value, L)``, every thread of the block at once, each resumed with its group's sum).
    Returns the threads that have not finished; all or none of them."""
    sums = [None] * len(threads)
    while True:
        requests = []
        for (who, thread), value in zip(threads, sums):
            memory.who = who
            try:
                requests.append(thread.send(value))
            except StopIteration:
                requests.append(StopIteration)
        if all(r is StopIteration for r in requests):
            return []
        assert StopIteration not in requests, "the threads of a block reach different __syncthreads"
        if all(r is None for r in requests):
            return threads
        assert all(isinstance(r, tuple) for r in requests), "a lane sum where another thread syncs"
        L = requests[0][1]
        assert all(r[1] == L for r in requests), "lane sums over groups of different sizes"
        groups = {}
        for tx, (value, _) in enumerate(requests):
            groups[tx // L] = groups.get(tx // L, 0.0) + value
        sums = [groups[tx // L] for tx in range(len(threads))]


def _is_call(e, op: str) -> bool:
    return isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == op


def run_kernel(func, arrays: dict) -> None:
    """Run a kernel as TVM's CUDA pipeline lowers it (a device PrimFunc) in Python: block by block,
    and in a block every thread up to its next __syncthreads before any goes on, all of them
    reaching the same ones. ``arrays``: flat arrays by the name of the parameter that holds their
    data, written in place; one not given (an intermediate buffer, rfactor's partial sums) is
    added as NaN. Races and accesses out of bounds raise; registers and shared memory start as NaN."""
    memory, launch, buffers, allocs = Memory(), {}, {}, []
    tvm_ffi.structural_walk(func.body, [
        (tvm.tirx.AttrStmt, lambda s: launch.update({s.node.var.name: int(s.value)})
         if s.attr_key == "thread_extent" else None),
        (tvm.tirx.DeclBuffer, lambda s: buffers.update({identifier(s.buffer.name): Buffer(
            s.buffer.name, arrays.setdefault(s.data.name, np.full(int(s.buffer.shape[0]), np.nan)), memory)})),
        (tvm.tirx.AllocBuffer, lambda s: allocs.append(s.buffer)),
    ])
    lines = ["def kernel():", *("    " + line for line in python_lines(func.body)), "    yield"]
    code = compile_text("\n".join(lines), "<kernel>")

    def grid(prefix):
        names = sorted(n for n in launch if n.startswith(prefix))
        return [{identifier(n): i for n, i in zip(names, index)}
                for index in itertools.product(*(range(launch[n]) for n in names))]

    def fresh(scope):
        return {identifier(b.name): np.full([int(d) for d in b.shape], np.nan) for b in allocs if b.scope() == scope}

    for bx, block in enumerate(grid("blockIdx")):
        shared = {n: Buffer(n, a, memory, shared=True) for n, a in fresh("shared").items()}
        threads = []
        for tx, thread in enumerate(grid("threadIdx")):
            scope = {"T": T, **buffers, **shared, **fresh("local"), **block, **thread}
            exec(code, scope)  # noqa: S102
            threads.append(((bx, tx), scope["kernel"]()))
        while threads:  # a phase: every thread on to its next __syncthreads
            memory.phase += 1
            threads = lockstep(threads, memory)
