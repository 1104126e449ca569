"""Buffers a compiled function keeps between its kernels, allocated by its caller.

A scheduled function's global-memory buffers (the hoisted input GEMM's output, packed weights, the
persistent kernel's exchange buffers, a recipe's own ``cache_write``) would otherwise be taken from
TVM's per-thread workspace pool: memory outside torch's caching allocator, which torch neither
sees nor reuses, and which a C++ destructor returns at thread or process exit. On CUDA that can be
after the CUDA runtime began unloading; TVM 0.27's ``cudaFree`` check then throws from the
destructor and the process aborts (``cudaErrorCudartUnloading``, seen at exit under torchrun).

``lift`` makes each such buffer a parameter of its function, after the others (role "scratch");
the runtime allocates them with the call's results (``frames.Pack``: one allocation a call). A
function for any sequence length has buffers whose rows follow T (``(T * B + 127) // 128 * 128``
rows of a padded GEMM): their dimensions are kept as expressions of T (``Dim``), which a call
evaluates for its own T and which an export's sidecar stores as JSON.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .runtime import STEPS, Arg

_OPS = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "//", tirx.FloorMod: "%",
        tirx.Min: "min", tirx.Max: "max"}


def lift(func: tirx.PrimFunc, only: tuple = None) -> tuple[tirx.PrimFunc, tuple[Arg, ...]]:
    """``func`` with every global-scope buffer it allocates (an ``AllocBuffer`` statement or a
    block's ``alloc_buffers``; with ``only``, those of these names) as a trailing parameter, and
    those parameters' ``Arg``s in order.
    For a scheduled function about to be built: blocks keep their read and write regions as they
    were (a buffer a block allocates is not among them). A global buffer allocated inside a
    parallel or thread-bound loop, one a task, is refused: one parameter would be shared by all."""
    lifted: list = []
    concurrent = [0]  # parallel and thread-bound loops around the node being visited

    def take(buffer) -> bool:
        if buffer.scope() != "global" or (only is not None and buffer.name not in only):
            return False
        if concurrent[0]:
            raise ValueError(f"buffer '{buffer.name}': a global buffer allocated inside a parallel or "
                             f"thread-bound loop cannot be passed in (its tasks would share it)")
        lifted.append(buffer)
        return True

    def loop(node, mutator):
        inside = node.kind in (tirx.ForKind.PARALLEL, tirx.ForKind.THREAD_BINDING)
        concurrent[0] += inside
        try:
            return mutator.default_mutate(node)
        finally:
            concurrent[0] -= inside

    def alloc_statement(node, mutator):
        return tirx.Evaluate(0) if take(node.buffer) else node

    def block(node, mutator):
        node = mutator.default_mutate(node)
        kept = [b for b in node.alloc_buffers if not take(b)]
        if len(kept) == len(node.alloc_buffers):
            return node
        return s_tir.SBlock(node.iter_vars, node.reads, node.writes, node.name_hint, node.body, node.init, kept,
                            node.match_buffers, node.annotations, node.span)

    def sequence(node, mutator):
        stmts = [s for s in (mutator.mutate(s) for s in node) if not _is_no_op(s)]
        return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts) if stmts else tirx.Evaluate(0)

    body = tvm_ffi.structural_mutate(func.body, ((tirx.For, loop), (tirx.AllocBuffer, alloc_statement),
                                                 (s_tir.SBlock, block), (tirx.SeqStmt, sequence)))
    if not lifted:
        return func, ()
    steps = next((p for p in func.params if p.name == STEPS), None)
    names = [p.name for p in func.params]
    args = []
    for buffer in lifted:
        if buffer.name in names:
            raise ValueError(f"buffer '{buffer.name}': a function's global buffers and parameters need distinct "
                             f"names to be passed in by name")
        names.append(buffer.name)
        shape = tuple(dimension_of(d, steps, buffer.name) for d in buffer.shape)
        args.append(Arg(buffer.name, shape, str(buffer.dtype), "scratch"))
    return tirx.PrimFunc([*func.params, *lifted], body, func.ret_type, func.attrs), tuple(args)


def lift_module(mod: tvm.IRModule, target, kept: tuple = ()) -> tuple[tvm.IRModule, dict[str, tuple[Arg, ...]]]:
    """``lift`` of each function of ``mod`` where ``target.lifts_scratch`` (the CUDA target; a target
    without the attribute keeps TVM's workspace but for the buffers named in ``kept``: those a
    caller may keep after the call, ``SequenceFunction.sequences_keeping``); the lifted ``Arg``s by
    function name."""
    only = None if getattr(target, "lifts_scratch", False) else tuple(kept)
    if only == ():
        return mod, {}
    out, scratch = tvm.IRModule({}, attrs=mod.attrs), {}
    for gvar, func in mod.functions.items():
        out[gvar], scratch[gvar.name_hint] = lift(func, only)
    return out, scratch


def _is_no_op(stmt) -> bool:
    return isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tirx.IntImm)


def dimension_of(expr, steps, name: str):
    """A buffer's dimension as an int, or where it follows T (``steps``, the function's variable) as a
    ``Dim`` tree: "T", an int, or (operator, left, right)."""
    if isinstance(expr, tirx.IntImm):
        return int(expr)

    def tree(e):
        if isinstance(e, tirx.IntImm):
            return int(e)
        if steps is not None and isinstance(e, tirx.Var) and e.same_as(steps):
            return "T"
        op = _OPS.get(type(e))
        if op is None:
            raise ValueError(f"buffer '{name}': a dimension {e} is not made of T and integers ({type(e).__name__}); "
                             f"a global buffer's shape may depend on the sequence length only")
        return (op, tree(e.a), tree(e.b))

    return tree(expr)
