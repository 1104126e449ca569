"""The persistent kernel's step GEMMs (``persistent_kernel.PersistentKernel``'s part): the weights
loaded into shared memory (or registers: ``resident_weights``), the operand staged or polled, and
each GEMM on tensor cores (WMMA fragments) or as a register tile of FFMA."""

from __future__ import annotations

from contextlib import nullcontext

from tvm import tirx
from tvm.script import tirx as T

from .block_gemm import FRAG, VECTOR, BlockGemm
from .cuda_tensorcore import BYTES
from .step_program import packings, rewrite
from .tir_build import loop, named, sync_threads, when, zero

# Rounds of the step's loads from global memory (the operand, the input projection) a thread has in
# flight at once. H100, LSTM fp16 T=100 B=64 H=1024, tensor cores: one load at a time (a rolled loop, 32
# rounds of 16 bytes a thread for the 128 KB operand) left 25 us a step whatever the GEMM's threads
# (128, 256, 512: 2.8, 2.5, 2.5 ms), against 4.4 us at B=16, H=512 (16 KB).
STAGING_UNROLL = 8


class StepGemms:
    """The step's GEMMs of a ``PersistentKernel``, which holds the knobs, the sizes, the buffers
    (``buf``) and the thread and block indices these methods read."""

    def load_weights(self, g: BlockGemm) -> None:
        """Columns k-contiguous: w_s[c * stride + k], zeros past K and past C (the columns padded to
        whole fragments), read where they are (the value ``layout.stacked`` packs: the parameter
        (N, K) itself for a GEMM of one matmul), k fastest: coalesced."""
        (k_iv, n_iv), weight = packings(self.p)[g.index]

        def body(q):
            c, k = q // g.stride, q % g.stride
            inside = tirx.And(k < g.K, c < g.C) if g.ldc > g.C else k < g.K
            column = self.global_column(T.min(c, g.C - 1) if g.ldc > g.C else c)
            value = rewrite(weight, [(k_iv, T.min(k, g.K - 1)), (n_iv, column)], self.buf)
            T.buffer_store(self.buf[f"w_s{g.index}"], T.if_then_else(inside, value, zero(self.p.dtype)), [q])

        self.flat(g.ldc * g.stride, body)

    def resident_weights(self, g: BlockGemm) -> None:
        """Before the time loop: the weight fragments of each of this warp's chunks into wf (registers),
        which the step's GEMM then uses in place of loads from w_s. Measured (H100, LSTM fp16
        (100,16,512)): cuDNN's persistent kernel keeps its weights in registers (144 a thread) and
        issued a third of the instructions of this kernel reloading them from shared memory;
        resident, the kernel took 3-12 % less (0.249 ms against 0.264 there, 2.754 against 3.128 at
        (1024,16,768))."""
        work, _, _, col = self.warp_tile(g)
        F, i = g.frags, g.index
        w_s, wf = self.buf[f"w_s{i}"], self.buf[f"wf{i}"]
        with T.sblock(f"resident_weights{i}"):
            T.reads(w_s[0:self.size(f"w_s{i}")])
            T.writes(wf[0:self.size(f"wf{i}")])
            with when(work < g.tiles * g.split) if g.idle else nullcontext():
                with loop(T.unroll, g.chunks, "p_c") as c, loop(T.unroll, F, "p_f") as f:
                    self.load_fragment(wf, c * F + f, w_s, (col + f * FRAG) * g.stride + self.chunk_k(g, c),
                                       g.stride, "col_major")

    def prefetch(self, i: int, name: str, columns: int, q) -> None:
        """The step's row block of a hoisted GEMM, the block's units' gate columns, into x_s[row * C + c]."""
        row, column = self.global_row(q // columns), self.global_column(q % columns)
        T.buffer_store(self.buf[f"x_s{i}"], self.buf[f"{name}_t"][row, column], [q])

    def operand(self, g: BlockGemm, row, k):
        """The step GEMM's operand at (row, k) of the batch and K, as staged: a state's view read from
        its sequence at step t, rounded to the weights' dtype on tensor cores (``BlockGemm.sized``)."""
        step, buffers = g.step, dict(self.buf)
        if step.reads_state:
            row = self.t * self.p.batch + row
            buffers |= {f"{s}_t": self.buf[f"{s}_seq"] for s in self.p.cell.states}
        value = rewrite(step.operand, [(step.row, row), (step.k, k)], buffers)
        return value if g.operand_dtype == step.dtype else T.Cast(g.operand_dtype, value)

    def staging_vector(self, g: BlockGemm) -> int:
        """Elements of the operand a thread stages at once."""
        v = 16 // BYTES[g.operand_dtype] if g.tensor_cores else VECTOR
        return v if g.K % v == 0 and self.H % v == 0 else 1

    def stage_operand(self, g: BlockGemm) -> None:
        """The step's B x K operand into a_s[row * stride + k], VECTOR at a time where rows allow
        (16 bytes on tensor cores, whose rows are whole 16 bytes)."""
        v = self.staging_vector(g)
        if self.polled:
            self.poll_operand(g, v)
            sync_threads()
            return
        per_row, count, a = g.K // v, g.B * g.K // v, self.operands[g.index]

        def store(q, element=None):  # at k = q % per_row * v (+ element)
            k = q % per_row * v if element is None else q % per_row * v + element
            at = q // per_row * a.stride + q % per_row * v
            T.buffer_store(self.buf[a.name], self.operand(g, self.global_row(q // per_row), k),
                           [at if element is None else at + element])

        def body(q):
            if v == 1:
                store(q)
                return
            with loop(T.vectorized, v, "p_v") as element:
                store(q, element)

        self.flat(count, body, STAGING_UNROLL)
        sync_threads()

    def poll_operand(self, g: BlockGemm, v: int) -> None:
        """The staging of ``stage_operand`` through the helpers of targets/cuda.py, from the second
        step (the first stages the initial state): after a block barrier, a thread's STAGING_UNROLL
        vectors of v elements are loaded together and reloaded until none holds the sentinel
        (``halstm_poll_stage``); with ``poll_waiters``, before that barrier one thread per unit group
        waits for the first value that group's block writes of this block's rows
        (``halstm_wait_value``). Without waiters the barrier still waits for the step's input
        projection (``prefetch``, issued first), which spaces the first polls from the step's end
        by a global load: polling at once is 1.4-1.6x slower (H100; the loads crowd L2 while the
        producers write), after the barrier 1-12 % faster than the waiters, whose phase was a third
        of the step (H100 fp16 T=100, prepared ms, LSTM
        (100,16,512) 0.234 / 0.265, (100,8,512) 0.228 / 0.240, (1024,16,768) 2.608 / 2.748, GRU
        (100,16,512) 0.226 / 0.230)."""
        per_row, count, word = g.K // v, g.B * g.K // v, BYTES[g.operand_dtype]
        a, view = self.buf[self.operands[g.index].name], self.buf[g.view]
        stride, started = self.operands[g.index].stride, self.t > 0
        if self.waiters:
            with loop(T.serial, -(-self.groups // self.threads), "p_w") as w:
                waiter = w * self.threads + self.tx
                with when(waiter < self.groups):
                    first = view.access_ptr("r", offset=self.global_row(0) * g.K + waiter * self.units)
                    T.evaluate(T.call_extern("void", f"halstm_wait_value<{word}>", started, first))
        sync_threads()
        rounds = -(-count // self.threads)
        unroll = min(STAGING_UNROLL, rounds)
        with loop(T.serial, -(-rounds // unroll), "p_r") as r:
            pointers = []
            for u in range(unroll):
                q = T.min((r * unroll + u) * self.threads + self.tx, count - 1)
                row, k = q // per_row, q % per_row * v
                pointers += [a.access_ptr("w", offset=row * stride + k),
                             view.access_ptr("r", offset=self.global_row(row) * g.K + k)]
            T.evaluate(T.call_extern("void", f"halstm_poll_stage<{v * word}, {word}>", started, *pointers))

    def warp_tile(self, g: BlockGemm, round_=None) -> tuple:
        """(work, part, row, column) of this warp's tile on tensor cores (in round ``round_``)."""
        warp = self.tx // 32
        work = warp if round_ is None else round_ * g.workers + warp
        part, tile = work % g.split, work // g.split
        return work, part, tile // (g.ldc // g.tn) * FRAG, tile % (g.ldc // g.tn) * g.tn

    def chunk_k(self, g: BlockGemm, c, round_=None):
        """k of chunk c of this warp's part on tensor cores."""
        return (c * g.split + self.warp_tile(g, round_)[1]) * FRAG

    def size(self, name: str) -> int:
        return next(n for buffer, n, *_ in self.buffers() if buffer == name)

    def load_fragment(self, frag, index, buffer, offset, stride, layout: str) -> None:
        """WMMA's load of fragment ``index`` of ``frag`` from ``buffer`` at ``offset``."""
        pointer = buffer.access_ptr("r", ptr_type=self.p.dtype, offset=offset)
        T.evaluate(T.tvm_load_matrix_sync(frag.data, 16, 16, 16, index, pointer, stride, layout, dtype="void"))

    def tensor_core_gemm(self, g: BlockGemm) -> None:
        """Warp (tile, part) multiplies 16 x 16 fragments of the operand (row-major: staged, or the
        state in global memory) and of the weight columns (column-major: k contiguous) into its tile's
        ``frags`` accumulators, fp32, each operand fragment feeding all of them, and stores its tile to
        part[part][row * ldc + column]; warps without a tile store zeros to the spare fragments. Its
        own block: TVM cannot infer what the fragment calls read and write (pointers)."""
        S, i, F = g.split, g.index, g.frags
        weights = f"wf{i}" if g.resident else f"w_s{i}"
        source = self.operands[i].name if self.staged else g.view
        with T.sblock(f"tensor_core_gemm{i}"):
            read = (self.buf[source][0:self.size(source)] if self.staged
                    else self.buf[source][0:self.p.batch, 0:g.K])
            T.reads(read, self.buf[weights][0:self.size(weights)])
            T.writes(self.buf[f"part{i}"][0:self.size(f"part{i}")])
            a_f = named("a_f", T.sblock_alloc_buffer((FRAG * FRAG,), self.p.dtype, scope="wmma.matrix_a", layout=None))
            b_f = None if g.resident else named("b_f", T.sblock_alloc_buffer(
                (FRAG * FRAG,), self.p.dtype, scope="wmma.matrix_b", layout=None))
            acc_f = named("acc_f", T.sblock_alloc_buffer((F * FRAG * FRAG,), "float32", scope="wmma.accumulator",
                                                          layout=None))
            with loop(T.serial, g.rounds, "p_t") if g.rounds > 1 else nullcontext() as round_:
                work, part, row, col = self.warp_tile(g, round_)
                with loop(T.unroll, F, "p_f") as f:
                    T.evaluate(T.tvm_fill_fragment(acc_f.data, 16, 16, 16, f, T.float32(0), dtype="void"))
                with when(work < g.tiles * S) if g.idle else nullcontext():
                    # unrolled where resident: a fragment's index must be a constant to stay in registers
                    with loop(T.unroll if g.resident else T.serial, g.chunks, "p_c") as c:
                        k = self.chunk_k(g, c, round_)
                        if self.staged:
                            a = self.operands[i]
                            self.load_fragment(a_f, 0, self.buf[a.name], row * a.stride + k, a.stride, "row_major")
                        else:  # each fragment straight from global memory (a deeper ring in flight: no faster)
                            self.load_fragment(a_f, 0, self.buf[g.view], self.global_row(row) * g.K + k, g.K,
                                               "row_major")
                        with loop(T.unroll, F, "p_f") as f:
                            if g.resident:
                                b, b_index = self.buf[f"wf{i}"], c * F + f
                            else:
                                b, b_index = b_f, 0
                                self.load_fragment(b_f, 0, self.buf[f"w_s{i}"], (col + f * FRAG) * g.stride + k,
                                                   g.stride, "col_major")
                            T.evaluate(T.tvm_mma_sync(acc_f.data, f, a_f.data, 0, b.data, b_index, acc_f.data, f,
                                                      dtype="void"))
                target = part * g.partial_stride + row * g.ldc + col
                if g.idle:
                    target = T.if_then_else(work < g.tiles * S, target, S * g.partial_stride)
                with loop(T.unroll, F, "p_f") as f:
                    pointer = self.buf[f"part{i}"].access_ptr("w", ptr_type="float32", offset=target + f * FRAG)
                    T.evaluate(T.tvm_store_matrix_sync(acc_f.data, 16, 16, 16, f, pointer, g.ldc, "row_major",
                                                       dtype="void"))

    def register_tile_gemm(self, g: BlockGemm) -> None:
        """Thread (tile, part) accumulates its tm x tn outputs in registers and stores them to
        part[part][row * C + column]."""
        S, tm, tn, V, i = g.split, g.tm, g.tn, VECTOR, g.index
        acc, a_r, w_r, w_s = self.buf["acc"], self.buf["a_r"], self.buf["w_r"], self.buf[f"w_s{i}"]
        with loop(T.serial, g.rounds, "p_t") if g.rounds > 1 else nullcontext() as round_:
            work = self.tx if round_ is None else round_ * self.threads + self.tx
            part, tile = work % S, work // S
            row = lambda p_i: tile // (g.C // tn) * tm + p_i  # noqa: E731
            column = tile % (g.C // tn) * tn  # + p_j

            def k(c, v, at=0):  # at + k of vector element v of chunk c, added term by term
                return at + (c * S + part) * V + v

            with loop(T.unroll, tm * tn, "p_i") as p_i:
                T.buffer_store(acc, T.float32(0), [p_i])
            # the threads past the tiles only load and sync
            with when(work < g.tiles * S) if g.tiles * S < g.rounds * self.threads else nullcontext():
                with loop(T.serial, g.chunks, "p_c") as c:
                    with loop(T.unroll, tm, "p_i") as p_i:
                        with loop(T.vectorized if self.staged else T.unroll, V, "p_v") as v:
                            if self.staged:
                                operand = self.operands[i]
                                a = self.buf[operand.name][k(c, v, row(p_i) * operand.stride)]
                            else:  # read from global memory, clamped: past the batch or K the weights or results are unused
                                a = self.operand(g, self.global_row(T.min(row(p_i), g.B - 1)), T.min(k(c, v), g.K - 1))
                            T.buffer_store(a_r, T.Cast("float32", a), [p_i * V + v])
                    with loop(T.unroll, tn, "p_j") as p_j, loop(T.vectorized, V, "p_v") as v:
                        w = w_s[k(c, v, (column + p_j) * g.stride)]
                        T.buffer_store(w_r, T.Cast("float32", w), [p_j * V + v])
                    with loop(T.unroll, V, "p_v") as v, loop(T.unroll, tm, "p_i") as p_i:
                        with loop(T.unroll, tn, "p_j") as p_j:
                            T.buffer_store(acc, acc[p_i * tn + p_j] + a_r[p_i * V + v] * w_r[p_j * V + v],
                                           [p_i * tn + p_j])
            with loop(T.unroll, tm, "p_i") as p_i, loop(T.unroll, tn, "p_j") as p_j:
                T.buffer_store(self.buf[f"part{i}"], acc[p_i * tn + p_j],
                               [part * g.partial_stride + row(p_i) * g.C + column + p_j])
