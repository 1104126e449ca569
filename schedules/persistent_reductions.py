"""The persistent kernel's reductions across the grid (``persistent_kernel.PersistentKernel``'s part):
a cell's sums over the hidden units (a layer norm's mean and variance), in rounds of one grid sync,
each block's partial sums exchanged through global memory."""

from __future__ import annotations

import functools
import itertools
import operator

from tvm import tirx
from tvm.script import tirx as T

from .step_program import Reduction, RowMath, loads, mean_of, rewrite
from .tir_build import loop, sync_grid, sync_threads, when


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
        """Floats of ``sum_s``: a thread's term of every (reduction, row) of a round (the group sums'
        of all its phases at once, the totals' of one)."""
        return max(max(len(level) * self.rows * self.units, *(len(phase) * self.rows * self.lanes(len(phase))
                                                               for phase in self.phases(level)))
                   for level in self.rounds())

    def lanes(self, reductions: int) -> int:
        """Threads that add the unit groups' partial sums of one row of one reduction (``total``):
        the most, a power of two up to a warp, that the block's threads hold for all of a round."""
        room = max(1, self.threads // (reductions * self.rows))
        return min(32, 1 << (min(room, self.groups).bit_length() - 1))

    def reduce(self, reductions: list[Reduction]) -> None:
        """Consecutive reductions, in rounds (``rounds``), one grid sync a round: each block sums its
        own columns of its rows into the round's ``parts`` (a row's partial sum a unit group, in global
        memory); after the grid sync, each block adds the unit groups' parts of its rows into shared
        memory, where the step's math reads them. Both sums in two passes over the block's threads,
        through ``sum_s``: a thread a (row, unit) or (row, lane) term, then a thread a row adding them.
        The parts alternate between two halves step by step (``parts_row``).

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
                self.group_sums(phase, phases[0], group, G)
            sync_grid()
            for phase in phases:
                self.total(phase, G)

    def group_sums(self, phase: list[Reduction], first: list[Reduction], group, G: int) -> None:
        """The block's part of each reduction of ``phase`` for each of its rows, into
        ``<reduction>_parts[row, group]``; a variance's around the block's part of its mean, summed
        again from the terms of the round's first phase (``first``), which the variances' terms
        leave in place."""
        rows, U, scratch = self.rows, self.units, self.buf["sum_s"]
        at = 0 if phase is first else len(first) * rows * U

        def part(i, local, start=at):  # the block's part of reduction i of a phase (from ``start``), row local
            return _sum(scratch[start + (i * rows + local) * U + u] for u in range(U))

        def unit_term(r, local, u):  # the unit's columns of every gate the reduction spans
            row, unit = self.global_row(local), self.first_unit + u
            mean = self.variances.get(r.buffer)
            centres = {} if mean is None else {
                mean.buffer: part(next(n for n, m in enumerate(first) if m is mean), local, 0) * G}
            return functools.reduce(operator.add, (
                rewrite(self.on_chip(r, local, u, gate, centres), [(r.row, row), (r.unit, gate * self.H + unit)],
                        self.buf)
                for gate in range(r.width // self.H)))

        self.over_items(phase, U, lambda i, r, local, u: T.buffer_store(
            scratch, unit_term(r, local, u), [at + (i * rows + local) * U + u]))
        sync_threads()
        self.over_items(phase, 1, lambda i, r, local, _: T.buffer_store(
            self.buf[f"{r.buffer}_parts"], part(i, local), [self.parts_row(local), group]))

    def total(self, phase: list[Reduction], G: int) -> None:
        """Each reduction of ``phase`` over the G groups' parts of each of the block's rows, into
        ``<reduction>_s``; a variance's with each group's deviation from the mean (``reduce``)."""
        rows, scratch, L = self.rows, self.buf["sum_s"], self.lanes(len(phase))

        def lane_term(r, local, lane):  # groups lane, lane + L, ...
            row, parts = self.parts_row(local), self.buf[f"{r.buffer}_parts"]
            mean = self.variances.get(r.buffer)
            if mean is None:
                term = lambda g: parts[row, g]
            else:
                means, S = self.buf[f"{mean.buffer}_parts"], self.buf[f"{mean.buffer}_s"][local]
                n = r.width // self.H * self.units
                term = lambda g: parts[row, g] + (means[row, g] - S / G) * (means[row, g] - S / G) / T.float32(n)
            terms = [term(lane + m * L) for m in range(G // L)]
            if G % L:
                last = lane + G // L * L
                terms.append(T.if_then_else(last < G, term(T.min(last, G - 1)), T.float32(0)))
            return _sum(terms)

        self.over_items(phase, L, lambda i, r, local, lane: T.buffer_store(
            scratch, lane_term(r, local, lane), [(i * rows + local) * L + lane]))
        sync_threads()
        self.over_items(phase, 1, lambda i, r, local, _: T.buffer_store(
            self.buf[f"{r.buffer}_s"], _sum(scratch[(i * rows + local) * L + lane] for lane in range(L)), [local]))
        sync_threads()

    def over_items(self, reductions: list[Reduction], per_row: int, body) -> None:
        """``body(i, reduction i, local row, j)`` for j < ``per_row`` of every row and reduction, a
        thread each."""
        rows, count = self.rows * per_row, len(reductions) * self.rows * per_row
        with loop(T.serial, -(-count // self.threads), "p_r") as r:
            work = r * self.threads + self.tx
            for i, reduction in enumerate(reductions):
                with when(tirx.And(i * rows <= work, work < (i + 1) * rows)):
                    item = work - i * rows
                    body(i, reduction, item // per_row, item % per_row)


def _reads(r: RowMath) -> set[str]:
    return {load.source.name for load in loads(r.value)}


def _sum(terms):
    return functools.reduce(operator.add, terms)
