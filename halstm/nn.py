"""PyTorch drop-in modules: torch.nn.LSTM/GRU's constructor, shapes, state layout and state_dict,
with any halstm cell underneath (``RNN(cell_type, ...)``).

Each layer and direction runs as one compiled halstm function over the whole sequence (compiled on
first use per sequence length, batch, dtype and device, then cached), called through the
``halstm::sequence`` op registered with ``torch.library``: tensors pass by DLPack on torch's current
CUDA stream, and its fake implementation lets ``torch.compile`` trace around it. Multi-layer with
dropout between layers, bidirectional, batch_first, and variable lengths (a ``lengths`` tensor or a
``PackedSequence``) behave as in torch.

Modules train: the op's backward (``halstm::sequence_backward``, registered with
``torch.library.register_autograd``) runs the backward through time that ``halstm.gradients``
compiles from the same cell, giving torch the gradients with respect to the input, every parameter
and the initial states of each layer direction.
"""

from __future__ import annotations

import math

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from . import cells as builtin
from .compiler import BUILD_LOCK, compile as compile_cell
from .gradients import compile_backward
from .lowering import cell_hash

# The op's key names a cell definition (its lowered expressions' hash), so that layers and modules
# with the same cell share compiled functions, and a key never refers to another cell.
_CELLS: dict[str, object] = {}  # key -> a cell with that definition
_COMPILED: dict[tuple, object] = {}  # (compiler, key, T, B, dtype, device) -> compiled function


def _compiled(compiler, key: str, x: torch.Tensor):
    """``compiler`` (halstm.compile or compile_backward) for the cell ``key`` at x's shape, dtype
    and device, compiled on first use (once: a thread that finds it being compiled waits for it)."""
    T, B, _ = x.shape
    cache = (compiler.__name__, key, T, B, x.dtype, x.device)
    f = _COMPILED.get(cache)
    if f is None:
        with BUILD_LOCK:
            f = _COMPILED.get(cache)
            if f is None:
                dtype = str(x.dtype).replace("torch.", "")
                f = _COMPILED[cache] = compiler(_CELLS[key], T, B, dtype, _target(x.device))
    return f


@torch.library.custom_op("halstm::sequence", mutates_args=())
def sequence_op(key: str, x: torch.Tensor, states: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every state of one layer direction at every step: a (T + 1, B, H) tensor per state."""
    cell = _CELLS[key]
    f = _compiled(compile_cell, key, x)
    seqs = f.sequences(x, dict(zip(cell.parameters(), params)), dict(zip(cell.states, states)))
    return [seqs[s] for s in cell.states]


@sequence_op.register_fake
def _(key, x, states, params):
    T, B, _ = x.shape
    return [x.new_empty((T + 1, B, s.shape[-1])) for s in states]


@torch.library.custom_op("halstm::sequence_backward", mutates_args=())
def sequence_backward_op(key: str, x: torch.Tensor, params: list[torch.Tensor], seqs: list[torch.Tensor],
                         grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """[dx, d initial state per state, d parameter per parameter] of one layer direction, given its
    state sequences and the gradients with respect to them."""
    cell = _CELLS[key]
    f = _compiled(compile_backward, key, x)
    dx, dparams, dstates = f(x, dict(zip(cell.parameters(), params)), dict(zip(cell.states, seqs)),
                             dict(zip(cell.states, grads)))
    return [dx, *(dstates[s] for s in cell.states), *(dparams[n] for n in cell.parameters())]


@sequence_backward_op.register_fake
def _(key, x, params, seqs, grads):
    return [torch.empty_like(x), *(torch.empty_like(s[0]) for s in seqs), *(torch.empty_like(p) for p in params)]


def _save(ctx, inputs, output):
    key, x, states, params = inputs
    ctx.key, ctx.counts = key, (len(params), len(states))
    ctx.save_for_backward(x, *params, *output)


def _backward(ctx, grads):
    (x, *saved), (n_params, n_states) = ctx.saved_tensors, ctx.counts
    params, seqs = saved[:n_params], saved[n_params:]
    grads = [torch.zeros_like(s) if g is None else g for g, s in zip(grads, seqs)]
    dx, *rest = sequence_backward_op(ctx.key, x, params, seqs, grads)
    return None, dx, rest[:n_states], rest[n_states:]


torch.library.register_autograd("halstm::sequence", _backward, setup_context=_save)


def _target(device: torch.device):
    if device.type == "cpu":
        return "cpu"
    from halstm.targets import CudaTarget

    return CudaTarget.detect(device.index or 0)


class RNN(torch.nn.Module):
    """A multi-layer, optionally bidirectional recurrent network of ``cell_type`` cells. With
    ``bias=False`` the cell's bias terms (``Cell.bias_parameters``) are zero and not parameters."""

    def __init__(self, cell_type, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if num_layers < 1 or not 0 <= dropout <= 1:
            raise ValueError(f"num_layers must be >= 1 and dropout in [0, 1], got {num_layers}, {dropout}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional = bidirectional
        self.directions = 2 if bidirectional else 1
        self._cells = {}
        for layer in range(num_layers):
            for direction in range(self.directions):
                size = input_size if layer == 0 else hidden_size * self.directions
                cell = cell_type(size, hidden_size)
                dropped = () if bias else cell.bias_parameters()
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                key = f"{cell.name}-{cell_hash(cell)}"
                _CELLS.setdefault(key, cell)
                self._cells[suffix] = (key, cell)
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
                f"bidirectional={self.bidirectional}")

    def forward(self, input, hx=None, lengths=None):
        """``input`` (T, B, I) (or (B, T, I) with batch_first, or a PackedSequence); ``hx`` the
        initial states as torch lays them out ((L * D, B, H) each; a tuple for several states);
        ``lengths`` (B,) for padded variable-length batches. Returns (output, final states)."""
        packed = isinstance(input, PackedSequence)
        if packed:
            input, lengths = pad_packed_sequence(input, batch_first=self.batch_first)
        x = input.transpose(0, 1) if self.batch_first else input
        T, B, _ = x.shape
        lengths = None if lengths is None else torch.as_tensor(lengths, device=x.device)
        initial = self._initial_states(hx, B, x)
        finals = {s: [] for s in self.cell.states}
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(self.directions):
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                key, cell = self._cells[suffix]
                index = layer * self.directions + direction
                states = [initial[s][index].contiguous() for s in cell.states]
                params = [self._param(name + suffix, shape, x) for name, shape in cell.parameters().items()]
                source = _reverse(x, lengths) if direction else x
                seqs = dict(zip(cell.states, sequence_op(key, source.contiguous(), states, params)))
                out = seqs[cell.output][1:]
                outputs.append(_reverse(out, lengths) if direction else out)
                for s in cell.states:
                    finals[s].append(_at_lengths(seqs[s], lengths, T))
            x = torch.cat(outputs, dim=2) if self.directions == 2 else outputs[0]
            if lengths is not None:
                x = x * (torch.arange(T, device=x.device)[:, None] < lengths[None, :])[..., None]
            if self.training and self.dropout and layer < self.num_layers - 1:
                x = torch.nn.functional.dropout(x, self.dropout, training=True)
        output = x.transpose(0, 1) if self.batch_first else x
        if packed:
            output = pack_padded_sequence(output, lengths.cpu(), batch_first=self.batch_first, enforce_sorted=False)
        final = tuple(torch.stack(finals[s]) for s in self.cell.states)
        return output, final[0] if len(final) == 1 else final

    def _param(self, name, shape, x):
        if name in self._parameters:
            return self._parameters[name]
        return x.new_zeros(shape)  # bias=False: the cell's declared bias terms are zero

    def _initial_states(self, hx, B, x):
        count = self.num_layers * self.directions
        if hx is None:
            zeros = x.new_zeros((count, B, self.hidden_size))
            return {s: zeros for s in self.cell.states}
        hx = (hx,) if isinstance(hx, torch.Tensor) else tuple(hx)
        if len(hx) != len(self.cell.states):
            raise ValueError(f"hx: expected {len(self.cell.states)} tensors {self.cell.states}, got {len(hx)}")
        for s, h in zip(self.cell.states, hx):
            if tuple(h.shape) != (count, B, self.hidden_size):
                raise ValueError(f"hx['{s}']: expected shape {(count, B, self.hidden_size)}, got {tuple(h.shape)}")
        return dict(zip(self.cell.states, hx))


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
