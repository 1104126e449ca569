"""halstm.nn takes what torch.nn.LSTM/GRU take, with torch's results: unbatched (T, I) input, both
layouts, empty batches (nothing compiled), ``lengths`` as torch's packed sequences; and refuses bad
input, initial states and lengths with a message naming expected and got, before anything compiles."""

import pytest

torch = pytest.importorskip("torch")
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

import halstm.nn  # noqa: E402
from conftest import rel_err  # noqa: E402

PAIRS = [(halstm.nn.LSTM, torch.nn.LSTM), (halstm.nn.GRU, torch.nn.GRU)]
H, T, B = 4, 5, 3  # tiny: quick compiles, shared by the tests (B = 1 for unbatched input)
I = 2 * H  # the second layer's input width (two directions): every layer one cell, compiled once
LAYERS = dict(num_layers=2, bidirectional=True)


def twins(ours, theirs, **kwargs):
    reference = theirs(input_size=I, hidden_size=H, **kwargs).eval()
    module = ours(input_size=I, hidden_size=H, **kwargs).eval()
    module.load_state_dict(reference.state_dict())
    return module, reference


def states(theirs, *shape):
    """Random initial states as the module takes them: (h, c) for an LSTM, h for a GRU."""
    h = torch.randn(*shape)
    return (h, torch.randn(*shape)) if theirs is torch.nn.LSTM else h


def as_tuple(t):
    return t if isinstance(t, tuple) else (t,)


def flat(t):
    return [u for v in t for u in flat(v)] if isinstance(t, tuple) else [t]


def same(got, want):
    """Same shapes, and values within 1e-5 relative norm error (float32); tensors or (nested) tuples."""
    got, want = flat(got), flat(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape, (a.shape, b.shape)
        assert rel_err(a.detach().numpy(), b.detach().numpy()) < 1e-5


@pytest.fixture
def nothing_compiles(monkeypatch):
    """Any compile fails the test: the checks (and empty batches) must come before compiling."""
    def refuse(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(halstm.nn, "compile_cell", refuse)
    monkeypatch.setattr(halstm.nn, "compile_backward", refuse)
    monkeypatch.setattr(halstm.nn, "_COMPILED", {})


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["TBI", "BTI"])
def test_batched_layouts_match_torch(ours, theirs, batch_first):
    module, reference = twins(ours, theirs, batch_first=batch_first, **LAYERS)
    x = torch.randn((B, T, I) if batch_first else (T, B, I))
    hx = states(theirs, 4, B, H)  # (layers * directions, B, H) in both layouts, as torch
    same(module(x, hx), reference(x, hx))
    same(module(x), reference(x))


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["TBI", "BTI"])
def test_unbatched_input_matches_torch(ours, theirs, batch_first):
    module, reference = twins(ours, theirs, batch_first=batch_first, **LAYERS)
    x = torch.randn(T, I)
    hx = states(theirs, 4, H)  # no batch dimension either
    (y, final), (y_ref, final_ref) = module(x, hx), reference(x, hx)
    assert y.shape == (T, 2 * H) and all(f.shape == (4, H) for f in as_tuple(final))
    same(y, y_ref)
    same(final, final_ref)
    same(module(x), reference(x))


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["TBI", "BTI"])
def test_empty_batch_gives_torch_shapes_without_compiling(ours, theirs, batch_first, nothing_compiles):
    module, reference = twins(ours, theirs, batch_first=batch_first, **LAYERS)
    x = torch.randn((0, T, I) if batch_first else (T, 0, I))
    hx = states(theirs, 4, 0, H)
    for args in [(x,), (x, hx)]:
        (y, final), (y_ref, final_ref) = module(*args), reference(*args)
        assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
        assert [f.shape for f in as_tuple(final)] == [f.shape for f in as_tuple(final_ref)]
    y, final = module(x, hx, lengths=torch.zeros(0, dtype=torch.int64))
    assert y.shape == reference(x)[0].shape


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["TBI", "BTI"])
@pytest.mark.parametrize("lengths", [torch.tensor([4, 1, 3]), [2, 4, 1], torch.tensor([3, 4, 2], dtype=torch.int32)],
                         ids=["int64", "list", "int32"])
def test_lengths_match_torch_packed(ours, theirs, batch_first, lengths):
    """``lengths`` as torch on the packed batch: outputs zero past each length, final states at it
    (the longest shorter than T: the last step is padding for every sequence)."""
    module, reference = twins(ours, theirs, batch_first=batch_first, **LAYERS)
    x = torch.randn((B, T, I) if batch_first else (T, B, I))
    hx = states(theirs, 4, B, H)
    y, final = module(x, hx, lengths=lengths)
    packed, final_ref = reference(pack_padded_sequence(x, torch.as_tensor(lengths), batch_first=batch_first,
                                                       enforce_sorted=False), hx)
    y_ref, _ = pad_packed_sequence(packed, batch_first=batch_first, total_length=T)
    same(y, y_ref)
    same(final, final_ref)


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
def test_packed_batch_first_with_initial_states_matches_torch(ours, theirs):
    """hx in the batch's own order (torch sorts and unsorts it around the packed sequence)."""
    module, reference = twins(ours, theirs, batch_first=True, **LAYERS)
    x = torch.randn(B, T, I)
    hx = states(theirs, 4, B, H)
    packed = pack_padded_sequence(x, torch.tensor([2, T, 3]), batch_first=True, enforce_sorted=False)
    (y, final), (y_ref, final_ref) = module(packed, hx), reference(packed, hx)
    (y, got), (y_ref, want) = pad_packed_sequence(y, batch_first=True), pad_packed_sequence(y_ref, batch_first=True)
    assert torch.equal(got, want)
    same(y, y_ref)
    same(final, final_ref)


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
def test_unbatched_length_is_a_scalar(ours, theirs):
    """One sequence, one length (no batch dimension, as hx): as torch on the sequence cut there."""
    module, reference = twins(ours, theirs, **LAYERS)
    x = torch.randn(T, I)
    y, final = module(x, lengths=3)
    y_ref, final_ref = reference(x[:3])
    same(y[:3], y_ref)
    assert torch.equal(y[3:], torch.zeros(T - 3, 2 * H))
    same(final, final_ref)


def test_torch_compile_traces_lengths():
    """Checking the lengths' values must not break a full-graph trace (it branches on data)."""
    module = halstm.nn.GRU(I, H, **LAYERS).eval()
    x, lengths = torch.randn(T, B, I), torch.tensor([T, 2, 4])
    with torch.no_grad():
        y, h = torch.compile(module, backend="eager", fullgraph=True)(x, lengths=lengths)
        y_eager, h_eager = module(x, lengths=lengths)
    assert torch.equal(y, y_eager) and torch.equal(h, h_eager)


# (input shape, hx shape (None: none given), lengths, the message expected); the module is a
# 2-layer bidirectional LSTM or GRU with I = 8, H = 4, time-major.
BAD = {
    "input-rank-4": ((T, B, 1, I), None, None, r"input: expected a 3-D batch or a 2-D sequence, got 4-D"),
    "input-rank-1": ((I,), None, None, r"input: expected a 3-D batch or a 2-D sequence, got 1-D"),
    "input-size": ((T, B, I + 2), None, None, r"expected 8 features \(input_size\) .*got 10"),
    "no-steps": ((0, B, I), None, None, r"expected a sequence length of at least 1, got 0"),
    "hx-batch": ((T, B, I), (4, B + 1, H), None, r"hx\['h'\]: expected shape \(4, 3, 4\) .*got \(4, 4, 4\)"),
    "hx-hidden": ((T, B, I), (4, B, H + 1), None, r"hx\['h'\]: expected shape \(4, 3, 4\) .*got \(4, 3, 5\)"),
    "hx-layers": ((T, B, I), (2, B, H), None, r"hx\['h'\]: expected shape \(4, 3, 4\) .*got \(2, 3, 4\)"),
    "hx-2d-for-batch": ((T, B, I), (4, H), None, r"hx\['h'\]: expected shape \(4, 3, 4\) .*got \(4, 4\)"),
    "hx-3d-for-unbatched": ((T, I), (4, 1, H), None, r"hx\['h'\]: expected shape \(4, 4\) .*unbatched.*got \(4, 1, 4\)"),
    "length-0": ((T, B, I), None, [3, 0, 2], r"lengths: expected each in \[1, 5\].*got 0 at index 1"),
    "length-past-T": ((T, B, I), None, [3, 2, T + 1], r"lengths: expected each in \[1, 5\].*got 6 at index 2"),
    "length-negative": ((T, B, I), None, [-1, 2, 2], r"got -1 at index 0"),
    "lengths-float": ((T, B, I), None, torch.tensor([3.0, 2.0, 1.0]), r"lengths: expected an integer dtype, got torch.float32"),
    "lengths-bool": ((T, B, I), None, torch.tensor([True, True, True]), r"expected an integer dtype, got torch.bool"),
    "lengths-count": ((T, B, I), None, [3, 2], r"lengths: expected shape \(3,\) \(one per sequence\), got \(2,\)"),
    "lengths-2d": ((T, B, I), None, [[3, 2, 1]], r"lengths: expected shape \(3,\).*got \(1, 3\)"),
    "lengths-for-unbatched": ((T, I), None, [3], r"lengths: expected shape \(\).*got \(1,\)"),
    "lengths-device": ((T, B, I), None, torch.tensor([3, 2, 1], device="meta"),
                       r"lengths: expected on the CPU or the input's device cpu, got meta"),
}


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_refused_before_compiling(ours, theirs, case, nothing_compiles):
    shape, hx_shape, lengths, message = BAD[case]
    module, reference = twins(ours, theirs, **LAYERS)
    x = torch.randn(shape)
    hx = None if hx_shape is None else states(theirs, *hx_shape)
    with pytest.raises(ValueError, match=message):
        module(x, hx, lengths=lengths)
    if lengths is None:  # torch refuses it too
        with pytest.raises((ValueError, RuntimeError)):
            reference(x, hx)


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
def test_dtype_mismatches_are_refused_before_compiling(ours, theirs, nothing_compiles):
    module, reference = twins(ours, theirs, **LAYERS)
    with pytest.raises(ValueError, match=r"input: expected dtype torch.float32 .*got torch.float64"):
        module(torch.randn(T, B, I, dtype=torch.float64))
    hx = states(theirs, 4, B, H)
    hx = tuple(h.double() for h in hx) if isinstance(hx, tuple) else hx.double()
    with pytest.raises(ValueError, match=r"hx\['h'\]: expected torch.float32 on cpu .*got torch.float64 on cpu"):
        module(torch.randn(T, B, I), hx)
    with pytest.raises(ValueError, match=r"input: expected device cpu .*got meta"):
        module(torch.randn(T, B, I, device="meta"))


def test_lstm_needs_both_states(nothing_compiles):
    module, _ = twins(halstm.nn.LSTM, torch.nn.LSTM)
    with pytest.raises(ValueError, match=r"hx: expected 2 tensors \('h', 'c'\), got 1"):
        module(torch.randn(T, B, I), torch.randn(1, B, H))


def test_lengths_with_a_packed_sequence_is_refused(nothing_compiles):
    module, _ = twins(halstm.nn.GRU, torch.nn.GRU)
    packed = pack_padded_sequence(torch.randn(T, B, I), [T, 2, 1])
    with pytest.raises(ValueError, match="lengths: a PackedSequence carries its own lengths"):
        module(packed, lengths=[T, 2, 1])
