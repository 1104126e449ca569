"""The persistent kernel's reductions across the grid (``persistent_kernel.PersistentKernel``'s part):
a cell's sums over the hidden units (a layer norm's mean and variance), in rounds of one exchange
across the grid (a grid sync, or polls of the parts), each block's partial sums exchanged through
global memory, added within a block by warp shuffles."""

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

    def items(self, level: list[Reduction]) -> list[Reduction]:
        """The round's reductions as a lane group sums them (``over_lanes``): each variance with its
        mean, and each other sum of the round alone."""
        centred = {m.buffer for r in level if (m := self.variances.get(r.buffer)) is not None}
        return [r for r in level if r.buffer not in centred]

    def lanes(self, items: int, most: int | None = None) -> int:
        """Threads that add the unit groups' partial sums of one row of an item (``total``), or with
        ``most`` its units' terms (``group_sums``): the most, a power of two up to a warp (and
        ``most``), that the block's threads hold for all items at once."""
        room = max(1, self.threads // (items * self.rows))
        return min(32, 1 << (min(room, self.groups if most is None else most).bit_length() - 1))

    def reduce(self, reductions: list[Reduction]) -> None:
        """Consecutive reductions, in rounds (``rounds``): each block sums its own columns of its rows
        into the round's parts in global memory (``sum_parts``: a row's partial sum a unit group);
        then, after a grid sync or polling the parts (poll_sums: ``stage_parts``), adds the unit
        groups' parts of its rows into ``sums_s``, where the step's math reads them. Both sums in
        one pass over the block's threads (``over_lanes``): a warp's lanes a (row, item), each lane
        its share of the units or of the groups' parts, added across the lanes by shuffles. The
        parts alternate between two halves step by step (``parts_row``).

        A variance's parts are each group's squared deviations from the group's own mean (its mean's
        part over the group's n columns); with G groups, the row's mean's sum S and the groups' parts
        s_g and q_g, the variance's sum is (Chan, Golub and LeVeque 1979)
        sum_g q_g + sum_g (s_g - S / G)^2 / n."""
        group = self.bx if self.row_blocks == 1 else self.bx % self.groups
        for level in self.rounds(reductions):
            self.group_sums(level, group)
            if self.poll_sums:  # the block's stores of its parts before its polls: the emulator's phases
                sync_threads()
                self.stage_parts(level)
            sync_threads() if self.poll_sums else sync_grid()
            self.total(level)
            sync_threads()

    def group_sums(self, level: list[Reduction], group) -> None:
        """The block's part of each reduction of the round ``level`` for each of its rows, into
        ``sum_parts``; a variance's around the block's part of its mean."""
        U, L = self.units, self.lanes(len(self.items(level)), self.units)

        def lane_term(r, local, lane, centre):  # units lane, lane + L, ...
            centres = {} if centre is None else {self.variances[r.buffer].buffer: centre * self.groups}
            return _lane_sum(lambda u: self.unit_term(r, local, u, centres), lane, L, U)

        self.over_lanes(self.items(level), L, lane_term,
                        lambda k, local, value: self.store_part(k, local, group, value))

    def unit_term(self, r: Reduction, local, u, centres: dict):
        """The unit's columns of every gate ``r`` spans, in local row ``local`` (``centres``: the
        block's part of a variance's mean, in place of the mean's sum)."""
        row, unit = self.global_row(local), self.first_unit + u
        return functools.reduce(operator.add, (
            rewrite(self.on_chip(r, local, u, gate, centres), [(r.row, row), (r.unit, gate * self.H + unit)], self.buf)
            for gate in range(r.width // self.H)))

    def total(self, level: list[Reduction]) -> None:
        """Each reduction of the round ``level`` over the G groups' parts of each of the block's rows,
        into ``sums_s``; a variance's with each group's deviation from the mean (``reduce``)."""
        G, L = self.groups, self.lanes(len(self.items(level)))

        def lane_term(r, local, lane, S):  # groups lane, lane + L, ...
            if S is None:
                term = lambda g: self.load_part(level, r, local, g)
            else:
                mean, n = self.variances[r.buffer], r.width // self.H * self.units
                deviation = lambda g: self.load_part(level, mean, local, g) - S / G
                term = lambda g: self.load_part(level, r, local, g) + deviation(g) * deviation(g) / T.float32(n)
            return _lane_sum(term, lane, L, G)

        self.over_lanes(self.items(level), L, lane_term, lambda k, local, value: T.buffer_store(
            self.buf["sums_s"], value, [k * self.rows + local]))

    def over_lanes(self, items: list[Reduction], L: int, term, store) -> None:
        """For every item and row of the block, the sum over L lanes (an aligned group of a warp's
        lanes, ``halstm_lane_sum``) of ``term(reduction, local row, lane, centre)``; a variance's
        first its mean's (centre None), then its own around that sum. The group's first lane
        ``store(reduction index, local row, sum)``s them. Every lane of a warp takes part in its
        sums (the thread's item clamped), so the stores alone are conditional."""
        rows, count, lane_r = self.rows, len(items) * self.rows * L, self.buf["lane_r"]
        means = [self.variances.get(r.buffer) for r in items]
        varied = [n for n, m in enumerate(means) if m is not None]
        with loop(T.serial, -(-count // self.threads), "p_r") as r:
            work = r * self.threads + self.tx
            item = T.min(work, count - 1)
            i, local, lane = item // (rows * L), item % (rows * L) // L, item % L

            def lane_sum(values, into):
                T.buffer_store(lane_r, T.call_extern("float32", "halstm_lane_sum", _select(i, values), L), [into])

            lane_sum([term(m or x, local, lane, None) for x, m in zip(items, means)], 0)
            if varied:
                lane_sum([term(x, local, lane, lane_r[0]) if m else T.float32(0) for x, m in zip(items, means)], 1)
            with when(T.And(work < count, lane == 0)):
                store(self.indices([m or x for x, m in zip(items, means)], i), local, lane_r[0])
                if len(varied) == len(items):
                    store(self.indices(items, i), local, lane_r[1])
                elif varied:
                    with when(functools.reduce(T.Or, [i == n for n in varied])):
                        store(self.indices(items, i), local, lane_r[1])

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
