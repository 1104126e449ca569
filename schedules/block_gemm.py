"""One step GEMM of the persistent kernel as a block computes it (``BlockGemm``): its tile, split-K
parts, buffers' sizes and strides for one setting of the recipe's knobs; the staged operands the
step's GEMMs share (``staged_operands``)."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

from tvm import tirx

from .step_program import StepGemm
from .wmma import FRAG

VECTOR = 4  # k a thread moves at once: operand staging, and shared memory to registers in the GEMM
# Weight fragments a warp may keep in registers for all steps (knob resident_weights): 4 registers
# each at fp16/bf16 (16 x 16 halfs over 32 lanes), 64 at most beside the accumulators: a budget chosen,
# not compared with others (ptxas: 58 registers a thread at LSTM fp16 B=16 H=512, 4 fragments a warp).
MAX_RESIDENT_FRAGS = 16

def _warp_frags(row_tiles: int, frags: int, warps: int, most: int) -> int:
    """Column fragments a warp: of the divisors of the block's ``frags`` up to ``most``, the fewest whose
    tiles share out evenly among the warps (no warp idle), else the most. H100, fp16 T=100:
    GRU (100,64,1024), 16 units x 2 row blocks, 48 columns: 1 fragment (6 tiles for 8 warps) 0.862 ms, 3
    (2 tiles, 4 split-K parts) 0.713; LSTM there (64 columns: 8 tiles) 1 fragment 0.929; LSTM (100,256,1024)
    streamed (8 x 4 fragments) 4 fragments 2.78-2.89, 2 3.81-3.87."""
    options = [f for f in range(1, most + 1) if frags % f == 0]
    return next((f for f in options if warps % (row_tiles * frags // f) == 0), options[-1])


@dataclass
class BlockGemm:
    """One step GEMM as a block computes it: B x C outputs (its rows of the batch, its units' columns
    of every gate) over K, in tiles of tm x tn: a thread's registers (FFMA), or a warp's 16 x 16
    fragments (tensor cores: ``frags`` of them side by side, tn = 16 x frags)."""

    index: int  # w_packed{index}, buffers *{index}
    name: str
    step: StepGemm  # the GEMM as the step program writes it: its operand at (row, k)
    operand_dtype: str  # what is staged: the operand's dtype, or the weights' (``sized``)
    B: int
    C: int
    K: int
    tm: int
    tn: int
    split: int  # S
    threads: int
    tensor_cores: bool = False
    view: str | None = None  # the buffer the operand is, read as stored at (row, k): h_t, or a scratch
    resident: bool = False  # the warp's weight fragments in registers for all steps (tensor cores)

    @classmethod
    def sized(cls, index, step, B, C, knobs, weights_dtype) -> BlockGemm:
        """The sizes that run for these knobs: the tile shrunk to the batch and to a divisor of the
        block's columns (FFMA) or 16 x 16 x ``_warp_frags`` fragments (tensor cores: the operand staged
        in the weights' dtype, a state as it is, a computed r * h rounded to it as a torch cell in that
        dtype rounds it); the most split-K parts (a power of two, at most ``max_split``) whose tiles the
        threads (warps) can hold, each part at least one chunk of K."""
        NT, K = knobs["threads"], step.gemm.depth
        tc, dtype, view = knobs["tensor_cores"], step.dtype, step.view
        if tc:
            tm, tn = FRAG, FRAG * _warp_frags(-(-B // FRAG), -(-C // FRAG), NT // 32, knobs["warp_frags"])
            if dtype != weights_dtype:
                dtype, view = weights_dtype, None
        else:
            tm = min(knobs["tile_rows"], B)
            tn = max(t for t in range(1, knobs["tile_cols"] + 1) if C % t == 0)
        g = cls(index, step.gemm.name, step, dtype, B, C, K, tm, tn, 1, NT, tc, view)
        while 2 * g.split <= knobs["max_split"] and 2 * g.split * g.tiles <= g.workers and 2 * g.split * g.width <= K:
            g.split *= 2
        g.resident = knobs["resident_weights"] and g.fits_registers
        return g

    @property
    def fits_registers(self) -> bool:
        """Whether a warp's weight fragments fit in registers for all steps (``resident``): tensor
        cores, one tile a warp, at most MAX_RESIDENT_FRAGS fragments over its chunks of K."""
        return self.tensor_cores and self.rounds == 1 and self.chunks * self.frags <= MAX_RESIDENT_FRAGS

    @property
    def workers(self) -> int:
        """What computes one tile: a thread, or a warp on tensor cores."""
        return self.threads // 32 if self.tensor_cores else self.threads

    @property
    def width(self) -> int:
        """k of one chunk: VECTOR a thread loads at once, or a fragment's 16."""
        return FRAG if self.tensor_cores else VECTOR

    @property
    def ldc(self) -> int:
        """Columns of the result buffers: C, padded to whole fragments on tensor cores."""
        return -(-self.C // FRAG) * FRAG if self.tensor_cores else self.C

    @property
    def frags(self) -> int:
        """16-column fragments in a warp's tile (tensor cores)."""
        return self.tn // FRAG

    @property
    def streams(self) -> bool:
        """Whether tensor cores can load the operand's fragments straight from global memory: a
        buffer read as stored, whole fragments of rows and of K (WMMA loads 32-byte aligned rows)."""
        return self.tensor_cores and self.view is not None and self.B % FRAG == 0 and self.K % FRAG == 0

    @property
    def row_tiles(self) -> int:
        return -(-self.B // self.tm)

    @property
    def tiles(self) -> int:
        return self.row_tiles * (self.ldc // self.tn)

    @property
    def rounds(self) -> int:
        """Tiles each worker computes one after the other (more than one only when S = 1)."""
        return -(-self.tiles * self.split // self.workers)

    @property
    def idle(self) -> bool:
        """Whether some workers have no tile in the last round."""
        return self.tiles * self.split < self.rounds * self.workers

    @property
    def chunks(self) -> int:
        """Chunks of k each part walks."""
        return -(-self.K // (self.split * self.width))

    @property
    def stride(self) -> int:
        """Row stride of the weight columns and of the staged operand (the widest of the GEMMs that
        share it): K padded to whole chunks of every part (zeros past K), plus 16 bytes so that rows
        start in different banks (a multiple of 8 elements, 16 bytes, as WMMA's loads need)."""
        pad = 8 if self.tensor_cores else VECTOR
        return self.chunks * self.split * self.width + pad

    @property
    def partial_stride(self) -> int:
        """Elements per part in the partial buffer: rows for every worker's tile, including workers
        without one (FFMA threads store zeros past the batch), padded to 1 mod 32 banks; on tensor
        cores whole fragments (then 32-byte aligned)."""
        if self.tensor_cores:
            return self.row_tiles * self.tm * self.ldc
        thread_tiles = -(-self.rounds * self.threads // self.split)
        rows = -(-thread_tiles // (self.C // self.tn)) * self.tm
        return rows * self.C + (1 - rows * self.C) % 32

    @property
    def partial_size(self) -> int:
        """The partial buffer: every part, and on tensor cores room for one more fragment (16 rows
        of ldc) that idle warps store to (a shared store is never inside a condition)."""
        spare = FRAG * self.ldc if self.tensor_cores and self.idle else 0
        return self.split * self.partial_stride + spare

    def result(self, buffers: dict, *terms) -> tirx.PrimExpr:
        """The GEMM's result at q = row * ldc + column (the sum of ``terms``), as the elementwise math
        reads it: its S partials in ``part{index}`` added there. A pass of all threads adding them
        into a buffer first, and two more block barriers a step, was 2-9 % slower (H100, T=100, prepared ms: fp16 LSTM
        (1024,16,768) 2.531 / 2.633, (512,64,512) 1.630 / 1.724, GRU (100,64,1024) 0.590 / 0.624
        with waiters, ResetBeforeGRU (100,16,512) 0.468 / 0.488; (100,16,512) 0.222 / 0.225)."""
        part = buffers[f"part{self.index}"]
        return functools.reduce(operator.add, (part[sum(terms, s * self.partial_stride)] for s in range(self.split)))


@dataclass(frozen=True)
class _Operand:
    """A staged-operand buffer, a_s[row * stride + k]: rows x stride elements of dtype."""

    name: str
    dtype: str
    rows: int
    stride: int


def staged_operands(gemms: list[BlockGemm]) -> dict[int, _Operand]:
    """Each GEMM's staged-operand buffer, by GEMM index: one a dtype, shared by the GEMMs that stage
    it (ResetBeforeGRU's h and r * h on tensor cores), so that shared memory holds the largest operand,
    not their sum. The GEMMs run one after the other (a sync ends each one's reads before the next
    stages), and with the rows and stride of the largest, k past K and rows past B stay zero for all."""
    out = {}
    for dtype in dict.fromkeys(g.operand_dtype for g in gemms):
        users = [g for g in gemms if g.operand_dtype == dtype]
        operand = _Operand(f"a_s{users[0].index}", dtype, max(g.row_tiles * g.tm for g in users),
                           max(g.stride for g in users))
        out |= {g.index: operand for g in users}
    return out
