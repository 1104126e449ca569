"""PyTorch drop-in modules: torch.nn.LSTM/GRU's constructor, shapes, state layout and state_dict,
with any halstm cell underneath (``RNN(cell_type, ...)``).

Each layer and direction runs as one compiled halstm function over the whole sequence (compiled on
first use per batch, dtype and device for every sequence length, then cached): tensors pass by DLPack on
torch's current CUDA stream. In eager mode ``_Sequence`` (a ``torch.autograd.Function``) calls it
directly; while ``torch.compile`` traces, the ``halstm::sequence`` op registered with
``torch.library`` does, its fake implementation letting the trace go around it. Multi-layer with
dropout between layers, bidirectional, batch_first, unbatched (2-D) input, empty batches (nothing
compiled), and variable lengths (a ``lengths`` tensor or a ``PackedSequence``) behave as in torch.
On the CPU with lengths each sequence stops at its own: the batch sorted by length runs in calls
over the rows still running (``segments``; their batch sizes rounded up to at most eight a batch,
``bucket``, each compiled once), so a batch costs about its lengths' sum, not T times B. On a GPU,
whose step time barely depends on its rows, every sequence runs all T steps (``_BY_LENGTH``).
Inputs, initial states and lengths are checked before anything compiles or runs.

Modules train: ``_Sequence.backward``, or the op's backward (``halstm::sequence_backward``,
registered with ``torch.library.register_autograd``), runs the backward through time that
``halstm.gradients`` compiles from the same cell, giving torch the gradients with respect to the
input, every parameter and the initial states of each layer direction. The forward and the backward
are each compiled once for every sequence length (``_ANY_STEPS``).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from . import cells as builtin
from .compiler import BUILD_LOCK, compile as compile_cell
from .gradients import compile_backward
from .lowering import cell_hash

def _compile_keeping(cell, steps, batch, dtype, target, allow_tf32: bool = False):
    """``halstm.compile`` of a training forward: where its recipe can (the CPU's step loop, the
    persistent kernel), its steps keep the first stage's GEMM results too (``keep_results``), which
    the backward then reads instead of computing them again (``_compile_backward_given_results``):
    one GEMM over all rows less (0.11 ms at LSTM fp16 (100,64,1024) on an H200), T*B rows of float32
    per GEMM more memory (``docs/results.md#training``)."""
    return compile_cell(cell, steps, batch, dtype, target, allow_tf32=allow_tf32, keep_results=True)


def _compile_backward_given(cell, steps, batch, dtype, target, allow_tf32: bool = False):
    """``compile_backward`` taking the forward's hoisted GEMM results (``given_hoisted``)."""
    return compile_backward(cell, steps, batch, dtype, target, allow_tf32=allow_tf32, given_hoisted=True)


def _compile_backward_given_results(cell, steps, batch, dtype, target, allow_tf32: bool = False):
    """``_compile_backward_given`` taking the first stage's GEMM results too (``given_results``:
    ``_compile_keeping``'s, where its recipe kept them)."""
    return compile_backward(cell, steps, batch, dtype, target, allow_tf32=allow_tf32, given_hoisted=True,
                            given_results=True)


# The op's key names a cell definition (its lowered expressions' hash, and _TF32_SUFFIX with allow_tf32), so
# that layers and modules with the same cell share compiled functions, and a key never refers to another
# cell.
_CELLS: dict[str, object] = {}  # key -> a cell with that definition
_TF32_SUFFIX = "-tf32"  # a key's float32 GEMMs may run as TF32 (``allow_tf32``)
_COMPILED: dict[tuple, object] = {}  # (compiler, key, T or None, B, dtype, device) -> compiled function
# the compilers whose functions serve every sequence length, by device type. H200, LSTM (100,16,512),
# (100,64,1024) and (100,256,1024), a backward for any T against one compiled for T=100: fp16 1.04-1.06x
# the time, TF32 1.05-1.08x (benchmarks/any_steps.py --backward); exact float32 1.03-1.07x
_ANY_STEPS = {device: {compile_cell, compile_backward, _compile_backward_given, _compile_backward_given_results,
                       _compile_keeping} for device in ("cpu", "cuda")}
# Device types where a batch with lengths runs each sequence to its own length (``_by_length_run``):
# where a step's time grows with its rows. A GPU's step is bound by its latency, not its rows, and
# runs every sequence all T steps: H100, LSTM fp16 (512,64,512) forward, lengths uniform in [1, T],
# 5.7 ms by length against 2.0 padded (the CPU: float32, 743 ms against 1075; benchmarks/packed.py).
_BY_LENGTH = {"cpu"}


def _compiled(compiler, key: str, x: torch.Tensor):
    """``compiler`` (halstm.compile or compile_backward) for the cell ``key`` at x's batch, dtype and
    device (and its sequence length, for a compiler whose functions serve one), compiled on first use
    (once: a thread that finds it being compiled waits for it)."""
    T, B, _ = x.shape
    steps = None if compiler in _ANY_STEPS[x.device.type] else T
    cache = (compiler.__name__, key, steps, B, x.dtype, x.device)
    f = _COMPILED.get(cache)
    if f is None:
        with BUILD_LOCK:
            f = _COMPILED.get(cache)
            if f is None:
                dtype = str(x.dtype).replace("torch.", "")
                f = _COMPILED[cache] = compiler(_CELLS[key], steps, B, dtype, _target(x.device),
                                                allow_tf32=key.endswith(_TF32_SUFFIX))
    return f


def _sequences(key: str, x: torch.Tensor, states, params, keep: bool = False) -> tuple[list[torch.Tensor], dict | None]:
    """Every state of one layer direction at every step: a (T + 1, B, H) tensor per state; with
    ``keep``, the hoisted GEMMs' results by name too (and the first stage's where its recipe keeps
    them: ``_compile_keeping``), for the backward to read (else None)."""
    cell = _CELLS[key]
    f = _compiled(_compile_keeping if keep else compile_cell, key, x)
    params, states = dict(zip(cell.parameters(), params)), dict(zip(cell.states, states))
    if keep:
        seqs, kept = f.sequences_keeping(x, params, states, f.program.kept)
    else:
        seqs, kept = f.sequences(x, params, states), None
    return [seqs[s] for s in cell.states], kept


def _gradients(key: str, x: torch.Tensor, params, seqs, grads, hoisted: dict | None = None) -> list[torch.Tensor]:
    """[dx, d initial state per state, d parameter per parameter] of one layer direction, given its
    state sequences and the gradients with respect to them (None where a state has none);
    ``hoisted``: the forward's hoisted GEMM results (``_sequences``' with ``keep``), else recomputed."""
    cell = _CELLS[key]
    if hoisted is None:
        f = _compiled(compile_backward, key, x)
    elif _compiled(_compile_keeping, key, x).program.keeps_results:
        f = _compiled(_compile_backward_given_results, key, x)
    else:
        f = _compiled(_compile_backward_given, key, x)
    dx, dparams, dstates = f(x, dict(zip(cell.parameters(), params)), dict(zip(cell.states, seqs)),
                             {s: g for s, g in zip(cell.states, grads) if g is not None}, hoisted)
    return [dx, *(dstates[s] for s in cell.states), *(dparams[n] for n in cell.parameters())]


@torch.library.custom_op("halstm::sequence", mutates_args=())
def sequence_op(key: str, x: torch.Tensor, states: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``_sequences`` as an op that ``torch.compile`` traces around."""
    return _sequences(key, x, states, params)[0]


@sequence_op.register_fake
def _empty_sequences(key, x, states, params):
    T, B, _ = x.shape
    return [x.new_empty((T + 1, B, s.shape[-1])) for s in states]


@torch.library.custom_op("halstm::sequence_backward", mutates_args=())
def sequence_backward_op(key: str, x: torch.Tensor, params: list[torch.Tensor], seqs: list[torch.Tensor],
                         grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``_gradients`` as an op that ``torch.compile`` traces around."""
    return _gradients(key, x, params, seqs, grads)


@sequence_backward_op.register_fake
def _(key, x, params, seqs, grads):
    return [torch.empty_like(x), *(torch.empty_like(s[0]) for s in seqs), *(torch.empty_like(p) for p in params)]


def _save(ctx, inputs, output):
    key, x, states, params = inputs
    ctx.key, ctx.counts = key, (len(params), len(states))
    ctx.save_for_backward(x, *params, *output)


def _backward(ctx, grads):
    (x, *saved), (n_params, n_states) = ctx.saved_tensors, ctx.counts
    dx, *rest = sequence_backward_op(ctx.key, x, saved[:n_params], saved[n_params:], list(grads))
    return None, dx, rest[:n_states], rest[n_states:]


def _no_second_derivative(ctx, grads):
    raise NotImplementedError("halstm.nn: second derivatives (differentiating a gradient taken with "
                              "create_graph=True) are not supported")


torch.library.register_autograd("halstm::sequence", _backward, setup_context=_save)
torch.library.register_autograd("halstm::sequence_backward", _no_second_derivative,
                                setup_context=lambda ctx, inputs, output: None)


class _Sequence(torch.autograd.Function):
    """``halstm::sequence`` and its backward outside ``torch.compile``: the compiled functions called
    directly, without the ops' dispatch, argument flattening and generated autograd node.
    ``apply(key, number of states, keep, x, *states, *params)``; with ``keep``, a forward whose
    backward will run keeps its hoisted GEMMs' results for it (``RNN``'s ``recompute``). A training
    step's host time, one layer, LSTM T=5 B=2 H=16 float32 on the 2-core CPU (``TVM_NUM_THREADS=1 python
    benchmarks/call_overhead.py LSTM 5,2,16 --training --reps 3000``): 337-391 us, 596-684 us through
    the ops, before the call plans (``SequenceFunction._plan_for``) and the reused scratch views
    (``ScratchPool.views``) took 7-9 % off it (the two ways swapped in blocks of steps in one process)."""

    @staticmethod
    def forward(ctx, key, count, keep, x, *tensors):
        keep = keep and any(ctx.needs_input_grad)
        seqs, ctx.hoisted = _sequences(key, x, tensors[:count], tensors[count:], keep)
        ctx.key = key
        ctx.set_materialize_grads(False)  # a state without a gradient: None, left out of the backward's grads
        ctx.save_for_backward(x, *tensors[count:], *seqs)
        return tuple(seqs)

    @staticmethod
    def backward(ctx, *grads):
        x, *saved = ctx.saved_tensors
        n_params = len(saved) - len(grads)
        # under create_graph, through the op, whose own backward refuses a second derivative
        if torch.is_grad_enabled():
            gradients = sequence_backward_op(ctx.key, x, saved[:n_params], saved[n_params:], list(grads))
        else:
            gradients = _gradients(ctx.key, x, saved[:n_params], saved[n_params:], list(grads), ctx.hoisted)
        return None, None, None, *gradients


def _run(key, x, states, params, keep: bool = True) -> list[torch.Tensor]:
    """A layer direction's state sequences, through the ops while ``torch.compile`` traces (whose
    backward computes the hoisted GEMMs again); ``keep``: see ``_Sequence``."""
    if torch.compiler.is_compiling():
        return sequence_op(key, x, states, params)
    # under no_grad no backward runs, though the inputs require gradients (ctx.needs_input_grad)
    return _Sequence.apply(key, len(states), keep and torch.is_grad_enabled(), x, *states, *params)


def _target(device: torch.device):
    if device.type == "cpu":
        return "cpu"
    from halstm.targets import CudaTarget

    return CudaTarget.detect(device.index or 0)


class RNN(torch.nn.Module):
    """A multi-layer, optionally bidirectional recurrent network of ``cell_type`` cells. With
    ``bias=False`` the cell's bias terms (``Cell.bias_parameters``) are zero and not parameters.
    ``allow_tf32=True`` lets float32 GEMMs, forward and backward, run on CUDA tensor cores as TF32
    (``halstm.compile``'s ``allow_tf32``; cuDNN's float32 default); without it float32 is exact.
    While training, each layer direction's forward keeps its hoisted GEMMs' results (T*B rows of
    the input projections, float32) for the backward; ``recompute=True`` has the backward compute
    them again instead: less memory between the passes, one GEMM over all rows more."""

    def __init__(self, cell_type, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None, allow_tf32: bool = False, recompute: bool = False):
        super().__init__()
        if num_layers < 1 or not 0 <= dropout <= 1:
            raise ValueError(f"num_layers must be >= 1 and dropout in [0, 1], got {num_layers}, {dropout}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.allow_tf32, self.recompute = bidirectional, bool(allow_tf32), bool(recompute)
        self.directions = 2 if bidirectional else 1
        self._layers = []  # per layer direction, in torch's order: (key, cell, ((parameter name, shape), ...))
        for layer in range(num_layers):
            for direction in range(self.directions):
                size = input_size if layer == 0 else hidden_size * self.directions
                cell = cell_type(size, hidden_size)
                dropped = () if bias else cell.bias_parameters()
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                key = f"{cell.name}-{cell_hash(cell)}" + (_TF32_SUFFIX if allow_tf32 else "")
                _CELLS.setdefault(key, cell)
                names = tuple((name + suffix, shape) for name, shape in cell.parameters().items())
                self._layers.append((key, cell, names))
                for name, shape in cell.parameters().items():
                    if name not in dropped:
                        self.register_parameter(name + suffix, torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        self.cell = cell
        self.reset_parameters()

    def reset_parameters(self):
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            torch.nn.init.uniform_(p, -bound, bound)

    def extra_repr(self):
        return (f"{self.cell.name}, {self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"bias={self.bias}, batch_first={self.batch_first}, dropout={self.dropout}, "
                f"bidirectional={self.bidirectional}" + (", allow_tf32=True" if self.allow_tf32 else "")
                + (", recompute=True" if self.recompute else ""))

    def forward(self, input, hx=None, lengths=None):
        """``input`` (T, B, I) (or (B, T, I) with batch_first, (T, I) for one sequence, or a
        PackedSequence); ``hx`` the initial states as torch lays them out ((L * D, B, H) each, or
        (L * D, H) for one sequence; a tuple for several states); ``lengths`` (B,) integers in
        [1, T] for padded variable-length batches (a scalar for one sequence), on the CPU or the
        input's device. Returns (output, final states), unbatched for unbatched input."""
        packed = isinstance(input, PackedSequence)
        if packed:
            if lengths is not None:
                raise ValueError("lengths: a PackedSequence carries its own lengths; pass one or the other")
            input, lengths = pad_packed_sequence(input, batch_first=self.batch_first)
        batched = self._check_input(input)
        if not batched:
            input = input.unsqueeze(0 if self.batch_first else 1)
        x = input.transpose(0, 1) if self.batch_first else input
        T, B, _ = x.shape
        initial = self._initial_states(hx, B, x, batched)
        lengths = None if lengths is None else _lengths(lengths, T, (B,) if batched else (), x.device)
        calls = _calls(lengths, x)
        finals = {s: [] for s in self.cell.states}
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(self.directions):
                index = layer * self.directions + direction
                key, cell, names = self._layers[index]
                params = [self._param(name, shape, x) for name, shape in names]
                source = _reverse(x, lengths) if direction else x
                out, ends = _layer_direction(key, source, initial[index], params, lengths, calls, not self.recompute)
                outputs.append(_reverse(out, lengths) if direction else out)
                for s, end in zip(cell.states, ends):
                    finals[s].append(end)
            x = torch.cat(outputs, dim=2) if self.directions == 2 else outputs[0]
            if lengths is not None:
                x = x * (torch.arange(T, device=x.device)[:, None] < lengths[None, :])[..., None]
            if self.training and self.dropout and layer < self.num_layers - 1:
                x = torch.nn.functional.dropout(x, self.dropout, training=True)
        output = x.transpose(0, 1) if self.batch_first else x
        if packed:
            output = pack_padded_sequence(output, lengths.cpu(), batch_first=self.batch_first, enforce_sorted=False)
        final = tuple(torch.stack(finals[s]) for s in self.cell.states)
        if not batched:
            output, final = output.squeeze(0 if self.batch_first else 1), tuple(f.squeeze(1) for f in final)
        return output, final[0] if len(final) == 1 else final

    def _param(self, name, shape, x):
        if name in self._parameters:
            return self._parameters[name]
        return x.new_zeros(shape)  # bias=False: the cell's declared bias terms are zero

    def _check_input(self, input) -> bool:
        """Whether ``input`` is batched (3-D) rather than one sequence (2-D); raises ValueError for
        another rank, a feature size other than input_size, no steps, or a dtype or device other
        than the parameters'."""
        if not isinstance(input, torch.Tensor) or input.dim() not in (2, 3):
            got = f"{input.dim()}-D, shape {tuple(input.shape)}" if isinstance(input, torch.Tensor) else type(input).__name__
            raise ValueError(f"input: expected a 3-D batch or a 2-D sequence, got {got}")
        if input.shape[-1] != self.input_size:
            raise ValueError(f"input: expected {self.input_size} features (input_size) in the last dimension, "
                             f"got {input.shape[-1]} (shape {tuple(input.shape)})")
        if input.shape[1 if self.batch_first and input.dim() == 3 else 0] == 0:
            raise ValueError(f"input: expected a sequence length of at least 1, got 0 (shape {tuple(input.shape)})")
        weight = next(iter(self._parameters.values()), None)
        if weight is not None and input.dtype != weight.dtype:
            raise ValueError(f"input: expected dtype {weight.dtype} (the parameters'), got {input.dtype}")
        if weight is not None and input.device != weight.device:
            raise ValueError(f"input: expected device {weight.device} (the parameters'), got {input.device}")
        return input.dim() == 3

    def _initial_states(self, hx, B, x, batched) -> list:
        """Each layer direction's initial states, (B, H) each in the cell's order of states (one zeros
        tensor for all without ``hx``); ``hx`` is checked against torch's layout (no batch dimension
        for unbatched input) and x's dtype and device."""
        count = self.num_layers * self.directions
        if hx is None:
            return [[x.new_zeros((B, self.hidden_size))] * len(self.cell.states)] * count
        hx = (hx,) if isinstance(hx, torch.Tensor) else tuple(hx)
        if len(hx) != len(self.cell.states):
            raise ValueError(f"hx: expected {len(self.cell.states)} tensors {self.cell.states}, got {len(hx)}")
        shape = (count, B, self.hidden_size) if batched else (count, self.hidden_size)
        layout = "(num_layers * num_directions, batch, hidden_size)" if batched else \
            "(num_layers * num_directions, hidden_size) for unbatched input"
        for s, h in zip(self.cell.states, hx):
            if tuple(h.shape) != shape:
                raise ValueError(f"hx['{s}']: expected shape {shape} {layout}, got {tuple(h.shape)}")
            if h.dtype != x.dtype or h.device != x.device:
                raise ValueError(f"hx['{s}']: expected {x.dtype} on {x.device} (the input's), got {h.dtype} on {h.device}")
        return [list(states) for states in zip(*((h if batched else h.unsqueeze(1)).unbind() for h in hx))]


def _calls(lengths, x):
    """(the batch's order by length, longest first, and its ``segments``) for the calls of
    ``_by_length_run``, the same for every layer direction of x (T, B, I); None without lengths, on a
    device outside _BY_LENGTH, while ``torch.compile`` traces (the calls depend on the lengths'
    values), for an empty batch, and where they would be one call over every row and all T steps,
    as without lengths."""
    T, B = x.shape[:2]
    if lengths is None or x.device.type not in _BY_LENGTH or torch.compiler.is_compiling() or B == 0:
        return None
    order = torch.argsort(lengths, descending=True, stable=True)
    calls = segments(lengths[order].tolist(), B)
    return None if calls == [(0, T, B)] else (order, calls)


def _layer_direction(key, x, states, params, lengths, calls, keep: bool = True):
    """A layer direction over x (T, B, I): its output (T, B, H), zero past each sequence's length,
    and each state after the sequence's last step. With ``lengths`` and their ``calls``, where the
    functions serve any sequence length (``_by_length``), each sequence stops at its own length;
    otherwise every one runs all T steps and the outputs past its length are masked by the caller.
    ``keep``: see ``_Sequence``."""
    cell = _CELLS[key]
    T, B = x.shape[:2]
    if calls is not None and _by_length(x, states, params):
        return _by_length_run(key, x, states, params, lengths, *calls, keep)
    seqs = _run(key, x.contiguous(), states, params, keep) if B else _empty_sequences(key, x, states, params)
    return seqs[cell.states.index(cell.output)][1:], [_at_lengths(seq, lengths, T) for seq in seqs]


def _by_length(x, states, params) -> bool:
    """Whether the sequences of a batch with lengths (and ``_calls``) run to their own lengths: where
    every function the pass needs serves any sequence length (each call over part of the steps would
    compile another otherwise)."""
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *states, *params))
    needs = {compile_cell, compile_backward} if training else {compile_cell}
    return needs <= _ANY_STEPS[x.device.type]


def bucket(rows: int, batch: int) -> int:
    """The batch size a call over ``rows`` running sequences of a batch of ``batch`` compiles for:
    ``rows`` rounded up to a multiple of 8 * ceil(batch / 64) (at most 8 sizes a batch), at most
    ``batch``."""
    step = 8 * -(-batch // 64)
    return min(batch, -(-rows // step) * step)


def segments(lengths: list[int], batch: int) -> list[tuple[int, int, int]]:
    """(first step, end step, rows) of the calls over a batch sorted by length, longest first: the
    rows still running at a step, rounded up to their ``bucket``, one call a run of steps with the
    same bucket."""
    T = max(lengths)
    ending = [0] * (T + 1)  # sequences of each length
    for n in lengths:
        ending[n] += 1
    running = list(itertools.accumulate(reversed(ending[1:])))[::-1]  # longer than t, at t
    out = []
    for t in range(T):
        rows = bucket(running[t], batch)
        if out and out[-1][2] == rows:
            out[-1] = (out[-1][0], t + 1, rows)
        else:
            out.append((t, t + 1, rows))
    return out


def _by_length_run(key, x, states, params, lengths, order, calls, keep: bool = True):
    """``_layer_direction`` with each sequence stopping at its own length: the batch in order of
    length, longest first, run in ``calls`` (its ``segments``), each over the rows still running
    (rounded up to a ``bucket``; the extra rows' results dropped) from the states the last call
    left, its rows of x gathered and its outputs scattered back in place, then zeroed past each
    length (where no call wrote); the cost that of the lengths' sum, not of T times the batch."""
    cell = _CELLS[key]
    T, B = x.shape[:2]
    L = lengths[order]
    state = [s[order] for s in states]
    ends = [torch.zeros_like(s) for s in state]
    out, output = x.new_empty((T, B, cell.hidden_size)), cell.states.index(cell.output)
    for t0, t1, rows in calls:
        seqs = _run(key, x[t0:t1].index_select(1, order[:rows]), [s[:rows] for s in state], params, keep)
        running = L[:rows]
        out[t0:t1].index_copy_(1, order[:rows], seqs[output][1:])
        ended = ((t0 < running) & (running <= t1))[:, None]
        at = (running - t0).clamp(0, t1 - t0).view(1, -1, 1)
        for i, seq in enumerate(seqs):
            last = seq.gather(0, at.expand(1, *seq.shape[1:]))[0]
            ends[i] = torch.cat([torch.where(ended, last, ends[i][:rows]), ends[i][rows:]])
            state[i] = torch.cat([seq[-1], state[i][rows:]])
    out.masked_fill_((torch.arange(T, device=x.device)[:, None] >= lengths[None, :])[..., None], 0)
    inverse = torch.argsort(order)
    return out, [e[inverse] for e in ends]


def _lengths(lengths, T, shape, device):
    """``lengths`` as int64 on ``device``, one per sequence, after checking them: of ``shape``, an
    integer dtype, on the CPU or ``device``, each in [1, T] (their values unchecked while
    ``torch.compile`` traces, which cannot branch on them); ValueError naming what is wrong."""
    lengths = torch.as_tensor(lengths)
    if tuple(lengths.shape) != shape:
        raise ValueError(f"lengths: expected shape {shape} (one per sequence), got {tuple(lengths.shape)}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ValueError(f"lengths: expected an integer dtype, got {lengths.dtype}")
    if lengths.device.type != "cpu" and lengths.device != device:
        raise ValueError(f"lengths: expected on the CPU or the input's device {device}, got {lengths.device}")
    values = lengths.reshape(-1).cpu()
    bad = [] if torch.compiler.is_compiling() else ((values < 1) | (values > T)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"lengths: expected each in [1, {T}] (the input's sequence length), "
                         f"got {values[bad[0]].item()} at index {bad[0]}")
    return lengths.reshape(-1).to(device=device, dtype=torch.int64)


def _reverse(x, lengths):
    """Each sequence reversed within its length (padding stays at the end)."""
    if lengths is None:
        return x.flip(0)
    T = x.shape[0]
    t = torch.arange(T, device=x.device)[:, None]
    index = torch.where(t < lengths[None, :], lengths[None, :] - 1 - t, t)
    return x.gather(0, index[..., None].expand_as(x))


def _at_lengths(seq, lengths, T):
    """The state after each sequence's last step: seq is (T + 1, B, H), the initial state first."""
    if lengths is None:
        return seq[T]
    return seq.gather(0, lengths.view(1, -1, 1).expand(1, *seq.shape[1:]))[0]


class LSTM(RNN):
    """torch.nn.LSTM's interface and state_dict, run by halstm."""

    def __init__(self, *args, **kwargs):
        super().__init__(builtin.LSTM, *args, **kwargs)


class GRU(RNN):
    """torch.nn.GRU's interface and state_dict, run by halstm."""

    def __init__(self, *args, **kwargs):
        super().__init__(builtin.GRU, *args, **kwargs)
