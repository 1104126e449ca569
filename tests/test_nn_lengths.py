"""halstm.nn with ``lengths``: each sequence stops at its own length (the batch sorted by length, the
calls over the rows still running, in ``segments``), with torch's packed-sequence results, outputs,
final states and gradients; padded, every sequence running all T steps, where a function the pass
needs is compiled for one sequence length."""

import pytest

torch = pytest.importorskip("torch")
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

import halstm.nn  # noqa: E402
from halstm.nn import bucket, segments  # noqa: E402
from conftest import representative  # noqa: E402
from test_nn_inputs import PAIRS, as_tuple, flat, same, states  # noqa: E402

H, T, B = 4, 9, 12  # B > 8: calls over fewer rows than the batch (its buckets: 8 and 12 rows)
I = 2 * H  # the second layer's input width (two directions): every layer and direction one cell, compiled once


def test_buckets_are_multiples_of_eight_up_to_the_batch_at_most_eight_sizes():
    assert [bucket(n, 20) for n in (1, 8, 9, 16, 17, 20)] == [8, 8, 16, 16, 20, 20]
    assert [bucket(n, 5) for n in (1, 5)] == [5, 5]
    assert [bucket(n, 100) for n in (1, 16, 17, 97)] == [16, 16, 32, 100]
    for batch in (1, 7, 8, 9, 64, 65, 100, 256, 1000):
        sizes = {bucket(n, batch) for n in range(1, batch + 1)}
        assert len(sizes) <= 8 and max(sizes) == batch and all(bucket(n, batch) >= n for n in range(1, batch + 1))


def test_segments_run_the_rows_still_running_rounded_up_to_their_bucket():
    lengths = sorted([9, 9, 7, 7, 7, 6, 5, 5, 5, 4, 4, 3, 3, 3, 2, 2, 1, 1, 1, 1], reverse=True)
    assert segments(lengths, 20) == [(0, 1, 20), (1, 5, 16), (5, 9, 8)]  # 20, 16, 14, 11, 9, 6, ... running
    assert segments([3, 3, 3], 3) == [(0, 3, 3)]  # one bucket: one call, to the longest length
    for t0, t1, rows in segments(lengths, 20):
        assert all(rows >= sum(n > t for n in lengths) for t in range(t0, t1))


def _recorded_calls(monkeypatch):
    calls = []
    run = halstm.nn._sequences

    def record(key, x, *args):
        calls.append(tuple(x.shape[:2]))
        return run(key, x, *args)

    monkeypatch.setattr(halstm.nn, "_sequences", record)
    return calls


def _twins(ours, theirs):
    reference = theirs(input_size=I, hidden_size=H, num_layers=2, bidirectional=True)
    module = ours(input_size=I, hidden_size=H, num_layers=2, bidirectional=True)
    module.load_state_dict(reference.state_dict())
    return module, reference


# CI: LSTM (two states, the tuple hx); GRU runs the same segments with one state (slow: its compiles, a
# forward and a backward for each bucket of rows, took 30 s on the 2-core CPU machine when the layers'
# input widths differed)
@pytest.mark.parametrize("ours, theirs", representative(PAIRS, ["LSTM", "GRU"], ["LSTM"]))
def test_each_sequence_stops_at_its_length_with_torch_packed_results_and_gradients(ours, theirs, monkeypatch):
    torch.manual_seed(1)
    module, reference = _twins(ours, theirs)
    lengths = torch.randint(1, T, (B,))
    x = torch.randn(T, B, I, requires_grad=True)
    hx = tuple(h.requires_grad_() for h in as_tuple(states(theirs, 4, B, H)))
    calls = _recorded_calls(monkeypatch)
    y, final = module(x, hx if len(hx) > 1 else hx[0], lengths=lengths)
    packed, final_ref = reference(pack_padded_sequence(x, lengths, enforce_sorted=False), hx if len(hx) > 1 else hx[0])
    y_ref, _ = pad_packed_sequence(packed, total_length=T)
    same(y, y_ref)
    same(final, final_ref)
    assert torch.equal(y[lengths.max():], torch.zeros(T - lengths.max(), B, 2 * H))

    cost = sum(steps * rows for steps, rows in calls)
    want = 4 * sum((t1 - t0) * rows for t0, t1, rows in segments(sorted(lengths.tolist(), reverse=True), B))
    assert cost == want < 4 * T * B  # two layers, two directions

    weights = torch.randn_like(y)
    grads = torch.autograd.grad(flat((y, final)), [x, *hx, *module.parameters()],
                                [weights, *(torch.ones_like(f) for f in flat(final))])
    grads_ref = torch.autograd.grad(flat((y_ref, final_ref)), [x, *hx, *reference.parameters()],
                                    [weights, *(torch.ones_like(f) for f in flat(final_ref))])
    for got, want_grad in zip(grads, grads_ref):
        same(got, want_grad)


@pytest.mark.parametrize("ours, theirs", PAIRS[:1], ids=["LSTM"])
def test_training_runs_padded_where_the_backward_serves_one_length(ours, theirs, monkeypatch):
    """As on a GPU, whose backward is compiled a sequence length: a call over part of the steps
    would compile another, so the training pass runs every sequence all T steps; inference still
    stops each at its length."""
    monkeypatch.setitem(halstm.nn._ANY_STEPS, "cpu", {halstm.nn.compile_cell})
    module, reference = _twins(ours, theirs)
    lengths = torch.tensor([T, 3, 5] + [2] * (B - 3))
    x = torch.randn(T, B, I, requires_grad=True)
    calls = _recorded_calls(monkeypatch)
    y, _ = module(x, lengths=lengths)
    assert calls == [(T, B)] * 4
    packed, _ = reference(pack_padded_sequence(x, lengths, enforce_sorted=False))
    same(y, pad_packed_sequence(packed, total_length=T)[0])
    calls.clear()
    with torch.no_grad():
        module(x, lengths=lengths)
    assert sum(steps * rows for steps, rows in calls) < 4 * T * B


def _runs_every_sequence_all_steps(device, monkeypatch, pair):
    """One call a layer direction, inference and training, with torch's packed results (cuDNN without
    TF32 on a GPU, to compare at 1e-5)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    module, reference = (m.to(device) for m in _twins(*pair))
    lengths = torch.randint(1, T, (B,))
    x = torch.randn(T, B, I, device=device)
    calls = _recorded_calls(monkeypatch)
    with torch.no_grad():
        y, final = module(x, lengths=lengths)
        packed, final_ref = reference(pack_padded_sequence(x, lengths, enforce_sorted=False))
    same(y.cpu(), pad_packed_sequence(packed, total_length=T)[0].cpu())
    same(tuple(f.cpu() for f in flat(final)), tuple(f.cpu() for f in flat(final_ref)))  # LSTM's (h, c), GRU's h
    module(x.requires_grad_(), lengths=lengths)[0].sum().backward()
    assert calls == [(T, B)] * 8


def test_a_device_outside_by_length_runs_every_sequence_all_steps(monkeypatch):
    """The GPU's policy (``halstm.nn._BY_LENGTH``), here on the CPU, with LSTM: the calls over the
    whole batch are those of the LSTM test above, whose functions a process compiles once (GRU's
    took 20 s of compiles on the 2-core CPU machine; the GPU test runs GRU)."""
    monkeypatch.setattr(halstm.nn, "_BY_LENGTH", set())
    _runs_every_sequence_all_steps("cpu", monkeypatch, PAIRS[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_every_sequence_runs_all_steps_with_torch_packed_results(monkeypatch):
    """A GPU's step time barely depends on its rows (``halstm.nn._BY_LENGTH``)."""
    _runs_every_sequence_all_steps("cuda", monkeypatch, PAIRS[1])
