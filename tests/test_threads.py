"""Compiling from several threads at once: halstm.compile, halstm.nn's first use of a shape, and
halstm.reference tracing while others compile."""

import threading
import time

import numpy as np
import pytest

import halstm
from halstm import linear, sigmoid, tanh
from conftest import TOLERANCE, random_inputs, rel_err

ROUNDS = 2


class GatedRNN(halstm.Cell):
    """A cell of two stages a step: the gate f, then a matmul of f * h."""

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"w_xf": (H, I), "w_hf": (H, H), "w_x": (H, I), "w_h": (H, H), "b": (H,)}

    def step(self, p, x, h):
        f = sigmoid(linear(x, p.w_xf, p.b) + linear(h, p.w_hf))
        return f * h + (1.0 - f) * tanh(linear(x, p.w_x) + linear(f * h, p.w_h))


class Dawdling(halstm.Cell):
    """A cell whose step pauses between its matmuls: a thread tracing it stays mid-trace a while."""

    def parameters(self):
        return {"w_x": (self.hidden_size, self.input_size), "w_h": (self.hidden_size, self.hidden_size)}

    def step(self, p, x, h):
        gate = linear(x, p.w_x)
        time.sleep(0.05)
        return tanh(gate + linear(h, p.w_h))


def run_at_once(functions):
    """Each function in a thread of its own, all started together: their results, or what they raised."""
    start = threading.Barrier(len(functions))
    results = [None] * len(functions)

    def run(i):
        start.wait()
        try:
            results[i] = functions[i]()
        except Exception as e:  # reported by the caller, with the others'
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(functions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_compiles_from_several_threads_at_once(rng):
    """Different cells and the same cell, four threads at a time, every result as the reference's."""
    cells = [halstm.LSTM(8, 16), halstm.GRU(8, 16), GatedRNN(8, 16), halstm.LSTM(8, 16)]
    for steps in range(3, 3 + ROUNDS):
        compiled = run_at_once([lambda cell=cell: halstm.compile(cell, steps, 2) for cell in cells])
        failed = [f"{cell!r}: {type(f).__name__}: {f}" for cell, f in zip(cells, compiled) if isinstance(f, Exception)]
        assert not failed, "\n".join(failed)
        for cell, f in zip(cells, compiled):
            x, params, states = random_inputs(cell, steps, 2, rng)
            y, _ = f(x, params, states)
            want, _ = halstm.reference(cell, x, params, states)
            assert rel_err(y, want) < TOLERANCE["float32"], (cell, steps)


def test_nn_compiles_a_new_shape_once_from_two_threads(monkeypatch):
    """Two threads run one module on a shape not compiled yet (inference: without gradients, the
    forward that keeps nothing): one compile of it, both outputs right."""
    torch = pytest.importorskip("torch")
    import halstm.nn

    compiled = []

    def counting(cell, *args, **options):
        compiled.append(args)
        return halstm.compile(cell, *args, **options)

    counting.__name__ = "compile"  # the cache's key names the compiler
    monkeypatch.setattr(halstm.nn, "compile_cell", counting)
    monkeypatch.setattr(halstm.nn, "_COMPILED", {})
    torch.manual_seed(0)
    ours, theirs = halstm.nn.LSTM(8, 16).eval(), torch.nn.LSTM(8, 16).eval()
    ours.load_state_dict(theirs.state_dict())
    for steps in range(3, 3 + ROUNDS):
        x = torch.randn(steps, 2, 8)
        def infer():  # no_grad is a thread's own
            with torch.no_grad():
                return ours(x)[0].numpy()

        outputs = run_at_once([infer] * 2)
        want = theirs(x)[0].detach().numpy()
        for y in outputs:
            assert not isinstance(y, Exception), f"{type(y).__name__}: {y}"
            assert rel_err(y, want) < TOLERANCE["float32"]
    assert [args[0] for args in compiled] == list(range(3, 3 + ROUNDS)), "one compile a shape"


def test_references_trace_while_other_threads_compile(rng):
    """Two threads run halstm.reference on an LSTM again and again while another compiles a cell that
    pauses mid-trace: tracing is one thread at a time, so no matmul goes to another thread's trace."""
    compiling, referred = Dawdling(8, 16), halstm.LSTM(8, 16)
    x, params, states = random_inputs(referred, 3, 2, rng)
    want, _ = halstm.reference(referred, x, params, states)
    done = threading.Event()

    def compile_two_shapes():
        try:
            return [halstm.compile(compiling, steps, 2) for steps in (3, 4)]
        finally:
            done.set()

    def refer():
        ys = [halstm.reference(referred, x, params, states)[0]]
        while not done.is_set():
            ys.append(halstm.reference(referred, x, params, states)[0])
        return ys

    compiled, *referring = run_at_once([compile_two_shapes, refer, refer])
    for result in (compiled, *referring):
        assert not isinstance(result, Exception), f"{type(result).__name__}: {result}"
    assert all(np.array_equal(y, want) for ys in referring for y in ys)
    for f in compiled:
        xs, ps, ss = random_inputs(compiling, f.program.steps, 2, rng)
        assert rel_err(f(xs, ps, ss)[0], halstm.reference(compiling, xs, ps, ss)[0]) < TOLERANCE["float32"]
