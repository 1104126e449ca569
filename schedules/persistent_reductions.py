"""The persistent kernel's reductions across the grid (``persistent_kernel.PersistentKernel``'s part):
a cell's sums over the hidden units (a layer norm's mean and variance), in rounds of one grid sync,
each block's partial sums exchanged through global memory."""

from __future__ import annotations

import functools
import itertools
import operator

from tvm.script import tirx as T

from .step_program import Reduction, RowMath, loads, mean_of, rewrite
from .tir_build import loop, sync_grid, sync_threads, when

POLLED_PARTS = 16  # a thread's polled reads of partial sums in flight together (``stage_parts``)


class GridReductions:
    """The reductions of a ``PersistentKernel``'s step, which holds the knobs, the sizes, the buffers
    (``buf``), the thread and block indices and the step's math (``on_chip``) these methods read."""

    @functools.cached_property
    def variances(self) -> dict[str, Reduction]:
        """Each reduction that sums squared deviations from another's mean (``step_program.mean_of``: a
        layer norm's variance), by buffer, with that mean's reduction: the two run in one round, each
        unit group's deviations taken from its own mean and merged (``reduce``); none without the
        knob merge_variances."""
        reductions = self.reductions if self.merge_variances else []
        return {r.buffer: m for r in reductions if (m := mean_of(r, reductions)) is not None}

    def rounds(self, reductions: list[Reduction] | None = None) -> list[list[Reduction]]:
        """Consecutive reductions of the step (``reductions``, or every run of them) in rounds: each
        round those that read no reduction of a later one, a variance in its mean's round."""
        if reductions is None:
            runs = itertools.groupby(self.blocks, lambda b: isinstance(b, Reduction))
            return [level for reduces, run in runs if reduces for level in self.rounds(list(run))]
        out, pending = [], list(reductions)
        while pending:
            names = {r.buffer for r in pending}
            out.append([r for r in pending if not (_reads(r) - self._centre(r)) & names])
            pending = [r for r in pending if all(r is not done for done in out[-1])]
        return out

    def _centre(self, r: Reduction) -> set[str]:
        mean = self.variances.get(r.buffer)
        return {mean.buffer} if mean else set()

    def phases(self, level: list[Reduction]) -> list[list[Reduction]]:
        """A round's reductions in the order ``reduce`` sums them: the means and other sums, then the
        variances (each of a mean of the round), those that there are."""
        return [phase for phase in ([r for r in level if r.buffer not in self.variances],
                                    [r for r in level if r.buffer in self.variances]) if phase]

    def scratch_size(self) -> int:
        """Floats of ``terms_s``: a thread's term of every (reduction, row) of a round (the group sums'
        of all its phases at once, the totals' of one)."""
        return max(max(sum(len(phase) * self.rows * self.lanes(len(phase), self.units) for phase in self.phases(level)),
                       *(len(phase) * self.rows * self.lanes(len(phase)) for phase in self.phases(level)))
                   for level in self.rounds())

    def lanes(self, reductions: int, most: int | None = None) -> int:
        """Threads that add the unit groups' partial sums of one row of one reduction (``total``), or
        with ``most`` its units' terms (``group_sums``): the most, a power of two up to a warp (and
        ``most``), that the block's threads hold for all of a phase at once."""
        room = max(1, self.threads // (reductions * self.rows))
        return min(32, 1 << (min(room, self.groups if most is None else most).bit_length() - 1))

    def reduce(self, reductions: list[Reduction]) -> None:
        """Consecutive reductions, in rounds (``rounds``): each block sums its own columns of its rows
        into the round's parts in global memory (``sum_parts``: a row's partial sum a unit group);
        then, after a grid sync or polling the parts (poll_sums: ``stage_parts``), adds the unit
        groups' parts of its rows into ``sums_s``, where the step's math reads them. Both sums in
        two passes over the block's threads, through ``terms_s``: a thread a (row, lane) term (its
        share of the units or of the groups' parts), then a thread a row adding them; each pass one store for all of its reductions
        (``over_items``), so that it needs no block barrier within. The parts alternate between two
        halves step by step (``parts_row``).

        A variance's parts are each group's squared deviations from the group's own mean (its mean's
        part over the group's n columns); with G groups, the row's mean's sum S and the groups' parts
        s_g and q_g, the variance's sum is (Chan, Golub and LeVeque 1979)
        sum_g q_g + sum_g (s_g - S / G)^2 / n."""
        G = self.groups
        group = self.bx if self.row_blocks == 1 else self.bx % G
        for level in self.rounds(reductions):
            phases = self.phases(level)
            for n, phase in enumerate(phases):
                if n:  # the variances' terms read their means' group sums
                    sync_threads()
                self.group_sums(phase, phases[0], group)
            if self.poll_sums:  # the block's stores of its parts before its polls: the emulator's phases
                sync_threads()
                self.stage_parts(level)
            sync_threads() if self.poll_sums else sync_grid()
            for phase in phases:
                self.total(phase, G, level)

    def group_sums(self, phase: list[Reduction], first: list[Reduction], group) -> None:
        """The block's part of each reduction of ``phase`` for each of its rows, into ``sum_parts``; a
        variance's around the block's part of its mean, summed again from the terms of the round's
        first phase (``first``), which the variances' terms leave in place."""
        rows, U, scratch = self.rows, self.units, self.buf["terms_s"]
        L, at = self.lanes(len(phase), U), 0 if phase is first else len(first) * rows * self.lanes(len(first), U)

        def part(i, local, L=L, at=at):  # the block's part of reduction i of a phase (from ``at``), row local
            return _sum(scratch[at + (i * rows + local) * L + lane] for lane in range(L))

        def lane_term(r, local, lane):  # units lane, lane + L, ...
            return _lane_sum(lambda u: unit_term(r, local, u), lane, L, U)

        def unit_term(r, local, u):  # the unit's columns of every gate the reduction spans
            row, unit = self.global_row(local), self.first_unit + u
            mean = self.variances.get(r.buffer)
            centres = {} if mean is None else {mean.buffer: part(
                next(n for n, m in enumerate(first) if m is mean), local, self.lanes(len(first), U), 0) * self.groups}
            return functools.reduce(operator.add, (
                rewrite(self.on_chip(r, local, u, gate, centres), [(r.row, row), (r.unit, gate * self.H + unit)],
                        self.buf)
                for gate in range(r.width // self.H)))

        self.over_items(phase, L, lane_term, lambda work, *_, value: T.buffer_store(scratch, value, [at + work]))
        sync_threads()
        self.over_items(phase, 1, None, lambda work, i, local, _: self.store_part(
            self.indices(phase, i), local, group, part(i, local)))

    def total(self, phase: list[Reduction], G: int, level: list[Reduction]) -> None:
        """Each reduction of ``phase`` over the G groups' parts of each of the block's rows, into
        ``sums_s``; a variance's with each group's deviation from the mean (``reduce``)."""
        rows, scratch, L = self.rows, self.buf["terms_s"], self.lanes(len(phase))

        def lane_term(r, local, lane):  # groups lane, lane + L, ...
            mean = self.variances.get(r.buffer)
            if mean is None:
                term = lambda g: self.load_part(level, r, local, g)
            else:
                S, n = self.sum_of(mean, local), r.width // self.H * self.units
                deviation = lambda g: self.load_part(level, mean, local, g) - S / G
                term = lambda g: self.load_part(level, r, local, g) + deviation(g) * deviation(g) / T.float32(n)
            return _lane_sum(term, lane, L, G)

        self.over_items(phase, L, lane_term, lambda work, *_, value: T.buffer_store(scratch, value, [work]))
        sync_threads()
        self.over_items(phase, 1, None, lambda work, i, local, _: T.buffer_store(
            self.buf["sums_s"], _sum(scratch[(i * rows + local) * L + lane] for lane in range(L)),
            [self.indices(phase, i) * rows + local]))
        sync_threads()

    def index(self, r: Reduction) -> int:
        """``r``'s place among the step's reductions: its rows in ``sums_s`` and ``sum_parts``."""
        return next(n for n, x in enumerate(self.reductions) if x is r)

    def indices(self, reductions: list[Reduction], i):
        """The place (``index``) of reduction i of ``reductions``, i an expression."""
        first = self.index(reductions[0])
        if all(self.index(r) == first + n for n, r in enumerate(reductions)):
            return first + i
        return _select(i, [self.index(r) for r in reductions])

    def sum_of(self, r: Reduction, local):
        """``r``'s sum of local row ``local`` in ``sums_s``."""
        return self.buf["sums_s"][self.index(r) * self.rows + local]

    def store_part(self, k, local, group, value) -> None:
        """The block's part of reduction k (``index``) for local row ``local``: with poll_sums, tagged
        with the step (``halstm_store_part``: the value and t + 1 in one 8-byte store)."""
        parts, row = self.buf["sum_parts"], k * 2 * self.p.batch + self.parts_row(local)
        if not self.poll_sums:
            T.buffer_store(parts, value, [row, group])
            return
        pointer = parts.access_ptr("w", offset=row * self.groups + group)
        T.evaluate(T.call_extern("void", "halstm_store_part", pointer, self.t + 1, value))

    def stage_parts(self, level: list[Reduction]) -> None:
        """With poll_sums, instead of a grid sync: every unit group's parts of the round's reductions
        (``level``) for the block's rows into ``parts_s``, each read past L1 until it carries this
        step's tag (``halstm_poll_parts``), up to POLLED_PARTS of a thread's reads in flight together."""
        rows, G, staged, parts = self.rows, self.groups, self.buf["parts_s"], self.buf["sum_parts"]
        count = rows * G  # parts of a reduction
        reads = [(k, n) for k in range(len(level)) for n in range(-(-count // self.threads))]
        for first in range(0, len(reads), POLLED_PARTS):
            pointers = []
            for k, n in reads[first:first + POLLED_PARTS]:
                q = T.min(n * self.threads + self.tx, count - 1)
                row = self.index(level[k]) * 2 * self.p.batch + self.parts_row(q // G)
                pointers += [staged.access_ptr("w", offset=k * count + q),
                             parts.access_ptr("r", offset=row * G + q % G)]
            T.evaluate(T.call_extern("void", "halstm_poll_parts", self.t + 1, *pointers))

    def load_part(self, level: list[Reduction], r: Reduction, local, group):
        """Unit group ``group``'s part of ``r`` (of the round ``level``) for local row ``local``: staged
        in ``parts_s`` with poll_sums, else in global memory after the round's grid sync."""
        if not self.poll_sums:
            return self.buf["sum_parts"][self.index(r) * 2 * self.p.batch + self.parts_row(local), group]
        k = next(n for n, x in enumerate(level) if x is r)
        return self.buf["parts_s"][(k * self.rows + local) * self.groups + group]

    def clear_parts(self) -> None:
        """Before the time loop, with poll_sums: every part tagged 0, a tag no step's part has (the
        buffer may hold an earlier call's tags)."""
        if not (self.reductions and self.poll_sums):
            return
        parts, count = self.buf["sum_parts"], len(self.reductions) * 2 * self.p.batch * self.groups
        with loop(T.serial, -(-count // (self.grid * self.threads)), "p_r") as n:
            i = (n * self.grid + self.bx) * self.threads + self.tx
            with when(i < count):
                T.buffer_store(parts, T.uint64(0), [i // self.groups, i % self.groups])

    def over_items(self, reductions: list[Reduction], per_row: int, value, store) -> None:
        """For j < ``per_row`` of every row and reduction, a thread each: ``store(work, i, local row,
        j, value=...)``, work the item's place (i * rows + local) * per_row + j; with ``value``,
        ``value(reduction, local, j)`` of the item's reduction i (chosen by ``T.if_then_else``). One
        store for all reductions: TVM's block barriers go between stores to shared memory it cannot
        tell apart."""
        rows, count = self.rows * per_row, len(reductions) * self.rows * per_row
        with loop(T.serial, -(-count // self.threads), "p_r") as r:
            work = r * self.threads + self.tx
            with when(work < count):
                i, local, j = work // rows, work % rows // per_row, work % per_row
                if value is None:
                    store(work, i, local, j)
                else:
                    store(work, i, local, j, value=_select(i, [value(x, local, j) for x in reductions]))


def _reads(r: RowMath) -> set[str]:
    return {load.source.name for load in loads(r.value)}


def _sum(terms):
    return functools.reduce(operator.add, terms)


def _lane_sum(term, lane, L: int, count: int):
    """The sum of term(j) for j < count in lane's share of them: lane, lane + L, ..."""
    terms = [term(lane + m * L) for m in range(count // L)]
    if count % L:
        last = lane + count // L * L
        terms.append(T.if_then_else(last < count, term(T.min(last, count - 1)), T.float32(0)))
    return _sum(terms)


def _select(i, values):
    """values[i], i an expression: a chain of ``T.if_then_else`` (in CUDA, of ternaries)."""
    return functools.reduce(lambda rest, n: T.if_then_else(i == n, values[n], rest),
                            range(len(values) - 2, -1, -1), values[-1])
