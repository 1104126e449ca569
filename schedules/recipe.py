"""The recipe base class and the rewrites recipes share."""

from __future__ import annotations

import itertools

import tvm
import tvm_ffi
from tvm.ir import TensorLoad
from tvm.s_tir import Schedule
from tvm.sym.analyzer import Analyzer
from tvm import tirx
from tvm.tirx import IntImm, IterVar
from tvm.tirx.analysis import undefined_vars

from halstm.layout import PackedLayout
from halstm.ops import same_extent


class Recipe:
    """A named schedule recipe with tunable knobs."""

    name = "recipe"
    knobs: dict[str, tuple] = {}
    # knobs that choose which kernels run: the defaults of the others follow their values (resolve)
    switches: tuple[str, ...] = ()
    # whether its schedule of a program lowered with ``keep_results`` writes the kept GEMM results
    keeps_results = False

    def is_applicable(self, program, target) -> bool:
        raise NotImplementedError

    def apply(self, program, target, **knobs) -> Schedule | None:
        raise NotImplementedError

    def layout(self, program, target, knobs: dict) -> PackedLayout:
        """How the packed GEMM weights are stored for this recipe (lowering reads it)."""
        return PackedLayout()

    def defaults(self, program, target, switches: dict | None = None) -> dict:
        """The knob values used without tuning (the first candidate of each), with ``switches``
        (values of some of ``self.switches``)."""
        return {**{k: v[0] for k, v in self.knobs.items()}, **(switches or {})}

    def runs(self, program, target, knobs: dict) -> bool:
        """Whether a knob setting can run here at all (threads, registers, shared memory,
        co-residency): ``halstm.compile`` refuses the others, naming them."""
        return True

    def valid(self, program, target, knobs: dict) -> bool:
        """Whether a knob setting is worth measuring here (the tuner measures only these): it runs,
        and a recipe may also prune settings known to be slow or to repeat another."""
        return self.runs(program, target, knobs)

    def space(self, program, target) -> list[dict]:
        """Every valid knob setting."""
        return [k for k in self.settings(self.knobs, {}) if self.valid(program, target, k)]

    def settings(self, names, base: dict) -> list[dict]:
        """Every combination of the values of knobs ``names`` over ``base`` (the other knobs at their
        first value unless ``base`` says), in the knobs' order."""
        first = {n: v[0] for n, v in self.knobs.items()}
        return [{**first, **base, **dict(zip(names, values))}
                for values in itertools.product(*(self.knobs[n] for n in names))]

    def resolve(self, program, target, knobs: dict | None) -> dict:
        unknown = set(knobs or {}) - set(self.knobs)
        if unknown:
            raise ValueError(f"recipe '{self.name}' has no knob(s) {sorted(unknown)}; it has {sorted(self.knobs)}")
        knobs = knobs or {}
        switches = {n: knobs[n] for n in self.switches if n in knobs}
        return {**self.defaults(program, target, switches), **knobs}

    def check_knobs(self, program, target, knobs: dict) -> str | None:
        """Why ``knobs`` (a setting read from a tuning record, say) cannot be used here, or None: the
        recipe does not apply, a knob it does not have, a value neither among the knob's candidates
        nor its default here (``defaults`` may compute one outside them, and the tuner records it;
        compared by type too: 1.0 is not 1, nor True 1), or a setting that does not ``run``. Not
        ``valid``: a setting it prunes from the search (slow, or repeating another) still runs right."""
        if not self.is_applicable(program, target):
            return f"recipe '{self.name}' does not apply to {program.cell!r} on {target.key}"
        unknown = set(knobs) - set(self.knobs)
        if unknown:
            return f"recipe '{self.name}' has no knob(s) {sorted(unknown)}"
        switches = {n: knobs[n] for n in self.switches if n in knobs}
        for name, value in switches.items():
            if not _among(value, self.knobs[name]):
                return f"knob {name}={value!r} is not one of {self.knobs[name]}"
        defaults = self.defaults(program, target, switches)
        for name, value in knobs.items():
            if not (_among(value, self.knobs[name]) or _among(value, (defaults[name],))):
                return f"knob {name}={value!r} is neither one of {self.knobs[name]} nor the default {defaults[name]!r}"
        if not self.runs(program, target, {**defaults, **knobs}):
            return "a tile or grid past the target's limits (threads, registers, shared memory, co-residency)"
        return None

    def __repr__(self):
        return f"{type(self).__name__}()"


def _among(value, candidates) -> bool:
    """Whether ``value`` is one of ``candidates``, of the same type (JSON reads 4.0 and true as such)."""
    return any(type(value) is type(c) and value == c for c in candidates)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def is_reduction(sch: Schedule, block) -> bool:
    return any(iv.iter_type == IterVar.CommReduce for iv in sch.get(block).iter_vars)


def divides(extent, n: int) -> bool:
    """Whether ``n`` provably divides a loop's ``extent``, a number or an expression in a function's
    sequence length (``lowering.hoisted_rows`` pads rows so that tiles divide them)."""
    if isinstance(extent, (int, IntImm)):
        return int(extent) % n == 0
    return Analyzer().can_prove(tvm.tirx.floormod(extent, n) == 0)


def is_pure_copy(sch: Schedule, block) -> bool:
    """A block that only moves (and perhaps casts) one value: a slice, a view, a dtype change."""
    value = sch.get(block).body.value
    while type(value).__name__ == "Cast":
        value = value.value
    return type(value).__name__ in ("BufferLoad", "TensorLoad")  # TVM 0.27 names the class TensorLoad


def only_moves(sch: Schedule, block) -> bool:
    """A block whose value is a load (``is_pure_copy``) or one of several picked by conditions: a
    gather from several buffers, as the backward's rows reads the reversed loop's gate blocks."""

    def moves(value) -> bool:
        while type(value).__name__ == "Cast":
            value = value.value
        if type(value).__name__ == "Call" and value.op.name.endswith(".if_then_else"):
            return moves(value.args[1]) and moves(value.args[2])
        return type(value).__name__ in ("BufferLoad", "TensorLoad")

    return moves(sch.get(block).body.value)


def _reads_only(sch: Schedule, consumer, block) -> bool:
    """Whether ``consumer`` reads nothing but ``block``'s result (and what it writes itself)."""
    node = sch.get(consumer)
    read = sch.get(block).writes[0].source
    return all(r.source.same_as(read) or any(r.source.same_as(w.source) for w in node.writes) for r in node.reads)


def copies_rows(sch: Schedule, block) -> bool:
    """Whether ``block`` copies elementwise along rows: two spatial loops, out[i, j] = src[i, j] (a
    cast of it, or where a condition holds, else a constant: zeros past a buffer's rows,
    ``lowering.hoisted_rows``' ``x_padded``; stacked weights zero past their rows), so that the
    columns of a row can move several at a time."""
    node = sch.get(block)
    if len(sch.get_loops(block)) != 2 or any(iv.iter_type != IterVar.DataPar for iv in node.iter_vars):
        return False
    value = node.body.value
    while type(value).__name__ == "Cast":
        value = value.value
    if type(value).__name__ == "Call" and value.op.name.endswith(".if_then_else") \
            and type(value.args[2]).__name__ in ("IntImm", "FloatImm"):
        value = value.args[1]
        while type(value).__name__ == "Cast":
            value = value.value
    indices = [iv.var for iv in node.iter_vars]
    return (type(value).__name__ in ("BufferLoad", "TensorLoad") and len(value.indices) == 2
            and all(i.same_as(v) for i, v in zip(value.indices, indices))
            and all(i.same_as(v) for i, v in zip(node.body.indices, indices)))


def reduces_columns(sch: Schedule, block) -> bool:
    """Whether ``block`` sums down columns (a bias gradient over T x B rows, d_bias[j] = sum over r
    of d[r, j]): one spatial and one reduce loop, some read strided along the reduced variable and
    none along the spatial one, so that threads at consecutive columns read consecutive elements
    or one (a row's own value: a layer norm's rstd[r] in its gain's gradient)."""
    iters = sch.get(block).iter_vars
    spatial = [iv.var for iv in iters if iv.iter_type == IterVar.DataPar]
    reduced = [iv.var for iv in iters if iv.iter_type == IterVar.CommReduce]
    if len(sch.get_loops(block)) != 2 or len(spatial) != 1 or len(reduced) != 1:
        return False
    reads = sch.get(block).reads
    return any(_strided(r, reduced[0]) for r in reads) and not any(_strided(r, spatial[0]) for r in reads)


def reduces_rows(sch: Schedule, block, lanes: int) -> bool:
    """Whether ``block`` sums along rows in whole SIMD vectors (a layer norm's statistics, sum over k of
    f(r, k)): one spatial and one reduce loop, its extent a multiple of ``lanes``, and every read
    that moves with the reduced variable moves along its last index only."""
    iters = sch.get(block).iter_vars
    reduced = [iv.var for iv in iters if iv.iter_type == IterVar.CommReduce]
    loops = sch.get_loops(block)
    if len(loops) != 2 or len(reduced) != 1 or len(iters) != 2:
        return False
    extent = sch.get(loops[1]).extent
    if not isinstance(extent, IntImm) or int(extent) % lanes:
        return False
    return not any(_uses(r.min, reduced[0]) for read in sch.get(block).reads for r in read.region[:-1])


def _strided(read, var) -> bool:
    """Whether ``read`` moves by whole rows as ``var`` does: ``var`` in an index but its last."""
    indices = [r.min for r in read.region]
    return bool(indices) and not _uses(indices[-1], var) and any(_uses(e, var) for e in indices[:-1])


def _uses(expr, var) -> bool:
    """Whether ``expr`` reads variable ``var``."""
    return any(v.same_as(var) for v in undefined_vars(expr, []))


def transposes(sch: Schedule, block) -> bool:
    """Whether ``block`` writes as rows what it reads as columns: a 2-D write whose row variable is in
    every read's last index and whose column's variables are in none (w_packed[k, n] = weights[n, k],
    an if_then_else over stacked weights; dgemm0_transposed[n, r] = dgemm0_seq[r, n]; a cast of
    one). Packed (N, K) (``PackedLayout.k_major``, or laid out so by the wgmma GEMM: wgmma.py) a
    weight is a copy; a block that also reads along its rows (y[b, n] = a[b, n] * rstd[b], a weight
    gradient's term flat[0, n * K + k]) transposes nothing."""
    write, reads = sch.get(block).writes[0].region, sch.get(block).reads
    if len(write) != 2:
        return False
    row, column = (r.min for r in write)
    return all(r.region and _uses(r.region[-1].min, row)
               and not any(_uses(r.region[-1].min, v) for v in undefined_vars(column, []))
               for r in reads)


def transposing_nest(sch: Schedule, block) -> list:
    """The blocks of ``block``'s two-loop nest where each ``transposes`` (outputs merged into one
    nest by merge_next_states), else none (another nest, a blocked layout's three loops)."""
    loops = sch.get_loops(block)
    nest = sch.get_child_blocks(loops[0]) if len(loops) == 2 else []
    return nest if nest and all(transposes(sch, b) for b in nest) else []


TRANSCENDENTAL = ("tirx.sigmoid", "tirx.tanh", "tirx.exp", "tirx.log", "tirx.erf")


def activations(sch: Schedule, scope) -> set[str]:
    """The blocks of a scope that apply a transcendental function to one value (a gate's sigmoid,
    tanh of the new cell state): where a differentiated step reads each in several adjoints, stored
    once instead of computed again in each (``inline_elementwise``'s ``keep``)."""
    names = set()
    for block in sch.get_child_blocks(scope):
        value = getattr(sch.get(block).body, "value", None)
        if type(value).__name__ == "Call" and getattr(value.op, "name", None) in TRANSCENDENTAL:
            names.add(sch.get(block).name_hint)
    return names


INLINE_CONDITIONS = 64  # conditions (Select, if_then_else) inlining a block may copy beyond one a consumer


def inline_elementwise(sch: Schedule, scope, keep=()) -> None:
    """Fuse the elementwise math of a scope into the blocks that write its results.

    Every elementwise block is inlined into its consumers, except one that feeds a reduction (a GEMM,
    a sum) with real arithmetic (the r * h operand of a later stage): that one is computed once and
    stored; so is a gather of several buffers (``only_moves``) that a GEMM reads (the reversed loop's
    operand, its gate blocks side by side: inlined into the CPU's GEMM, LSTM (100,16,512)'s loop took
    42.9 ms against 20.3), which a sum of it alone reads inlined.
    Output blocks (those writing the scope's views) and blocks named in ``keep`` stay, and so does a
    block that its consumers read so often that inlining would copy more than INLINE_CONDITIONS of
    its conditions (``_copied_conditions``).
    """
    changed = True
    while changed:
        changed = False
        for block in sch.get_child_blocks(scope):
            if is_reduction(sch, block) or sch.get(block).name_hint in keep:
                continue
            consumers = sch.get_consumers(block)
            if not consumers:  # writes an output view
                continue
            reductions = [c for c in consumers if is_reduction(sch, c)]
            if reductions and not (is_pure_copy(sch, block) or only_moves(sch, block)
                                   and all(_reads_only(sch, c, block) for c in reductions)):
                continue
            if _copied_conditions(sch, block, consumers) > INLINE_CONDITIONS:
                continue
            sch.compute_inline(block)
            changed = True
            break


def _copied_conditions(sch: Schedule, block, consumers) -> int:
    """The conditions (Select, if_then_else) of ``block``'s expression that inlining it would add to
    its consumers beyond one copy each. Nested clamps multiply them (torch's NaN-propagating
    ``maximum`` reads each operand three times): GatedNormRNN's clamped state, read four times by
    its output, became a 300 KB expression whose conditions TVM's buffer compaction (which narrows
    regions under each) did not get through in minutes; kept, 116 to 348 copies a block. RGLRU
    copies 11 (its log1p's series branch) and is inlined as before."""
    node = sch.get(block)
    written = node.writes[0].source
    conditions, reads = [0], 0

    def select(_):
        conditions[0] += 1

    def call(c):
        conditions[0] += getattr(c.op, "name", "").endswith(".if_then_else")

    tvm_ffi.structural_walk(node.body.value, [(tirx.Select, select), (tvm.ir.Call, call)])
    for consumer in consumers:
        loads = [0]

        def load(n):
            loads[0] += n.source.same_as(written)

        tvm_ffi.structural_walk(sch.get(consumer).body, (TensorLoad, load))
        reads += max(loads[0] - 1, 0)
    return conditions[0] * reads


def in_k_slices(sch: Schedule, block) -> bool:
    """Whether a GEMM block sums K in slices (PackedLayout.split_k): iteration variables s, b, n, k."""
    return len(sch.get(block).iter_vars) == 4


def child_blocks(sch: Schedule, scope_name: str, program):
    """(GEMMs the plan made, other blocks) directly inside the named scope block. A cell's own
    reductions (a layer norm's sums) are other blocks."""
    names = {g.name for g in program.plan.gemms}
    gemms, others = [], []
    for block in sch.get_child_blocks(sch.get_sblock(scope_name)):
        (gemms if sch.get(block).name_hint in names else others).append(block)
    return gemms, others


def merge_next_states(sch: Schedule, scope, blocks: list) -> list:
    """Put adjacent blocks that write next states over the same (B, H) into one loop nest: one
    parallel region (CPU) or one kernel (CUDA) a step instead of one per state (LSTM: h and c), and
    the compiler computes the gate math they share once. Only adjacent ones: ``merge`` does not
    check dependences, and a block between them (a layer norm's reduction, say) may feed the later
    one. Returns ``blocks`` without those merged into an earlier one."""

    def key(b):
        if sch.get_consumers(b) or is_reduction(sch, b):
            return None
        return [sch.get(loop).extent for loop in sch.get_loops(b)]

    def same_nest(a, b) -> bool:
        return a is not None and b is not None and len(a) == len(b) and all(map(same_extent, a, b))

    runs: list[list] = []
    for b in sch.get_child_blocks(scope):  # in program order, GEMMs included: they break runs
        if runs and same_nest(key(b), key(runs[-1][-1])):
            runs[-1].append(b)
        else:
            runs.append([b])
    merged_away = set()
    for run in runs:
        if len(run) > 1:
            sch.merge(*[sch.get_loops(b)[-1] for b in run])
            merged_away |= {sch.get(b).name_hint for b in run[1:]}
    return [b for b in blocks if sch.get(b).name_hint not in merged_away]
