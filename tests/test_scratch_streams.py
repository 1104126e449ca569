"""A compiled function's scratch buffers on a GPU (``frames.ScratchPools``): a call gives its
allocation back once it has launched its kernels, so the next call on the same CUDA stream takes it;
a call on another stream, or one captured in a CUDA graph, must not."""

import numpy as np
import pytest

import halstm
from conftest import TOLERANCE, random_inputs, rel_err
from halstm.frames import TorchFrame

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

T, B, H = 6, 4, 32


@pytest.fixture(scope="module")
def lstm():
    cell = halstm.LSTM(H, H)
    return cell, halstm.compile(cell, T, B, "float32", target="cuda", database=False)


def _call(f, cell, rng):
    """A call on fresh inputs (torch tensors on the GPU), with what float64 says of its output."""
    x, params, states = random_inputs(cell, T, B, rng)
    want, _ = halstm.reference(cell, x, params, states)
    on_gpu = lambda a: torch.from_numpy(np.asarray(a)).cuda()
    y, _ = f(on_gpu(x), {n: on_gpu(v) for n, v in params.items()}, {n: on_gpu(v) for n, v in states.items()})
    return y, want


def _pooled(f, stream) -> list:
    """The allocations kept for ``stream`` (data pointers)."""
    pool = f._scratch_pools._pools.get((torch.cuda.current_device(), stream.cuda_stream))
    return [] if pool is None else [flat.data_ptr() for flat in pool._free]


def test_calls_on_one_stream_take_turns_and_streams_keep_their_own(lstm, rng):
    cell, f = lstm
    if not f.scratch:
        pytest.skip("this recipe's function has no scratch buffers")
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    results = []
    with torch.cuda.stream(first):
        results.append(_call(f, cell, rng))
        kept = _pooled(f, first)
        results.append(_call(f, cell, rng))
        assert _pooled(f, first) == kept and len(kept) == 1
    with torch.cuda.stream(second):
        results.append(_call(f, cell, rng))
        assert len(_pooled(f, second)) == 1 and _pooled(f, second) != kept
    torch.cuda.synchronize()
    assert all(rel_err(y.cpu().numpy(), want) < TOLERANCE["float32"] for y, want in results)


def test_a_captured_call_keeps_its_own_scratch(lstm, rng):
    """A call captured in a CUDA graph neither takes a pooled allocation nor gives one back (the graph
    reads its buffers at every replay, and a pooled one may be freed meanwhile); the graph's replays
    between eager calls on its stream stay right."""
    cell, f = lstm
    x, params, states = random_inputs(cell, T, B, rng)
    want, _ = halstm.reference(cell, x, params, states)
    on_gpu = lambda a: torch.from_numpy(np.asarray(a)).cuda()
    args = on_gpu(x), {n: on_gpu(v) for n, v in params.items()}, {n: on_gpu(v) for n, v in states.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        f(*args)  # warm-up, as torch asks before a capture
        assert TorchFrame(args[0], None, False).pool_key() is not None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y, _ = f(*args)
        assert TorchFrame(args[0], None, False).pool_key() is None
    with torch.cuda.stream(stream):
        for _ in range(2):
            _call(f, cell, rng)  # eager calls on the stream the graph replays on, other inputs
            graph.replay()
            got = y.clone()
            stream.synchronize()
            assert rel_err(got.cpu().numpy(), want) < TOLERANCE["float32"]
