"""halstm.nn against torch.nn on the same state_dict: layers, directions, batch_first, lengths."""

import pytest

torch = pytest.importorskip("torch")
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

import halstm  # noqa: E402
import halstm.nn  # noqa: E402
from conftest import rel_err  # noqa: E402

PAIRS = [(halstm.nn.LSTM, torch.nn.LSTM), (halstm.nn.GRU, torch.nn.GRU)]


def twins(ours, theirs, **kwargs):
    reference = theirs(**kwargs).eval()
    module = ours(**kwargs).eval()
    module.load_state_dict(reference.state_dict())  # torch's state_dict as it is (strict)
    return module, reference


def close(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return all(rel_err(x.detach().numpy(), y.detach().numpy()) < 1e-5 for x, y in zip(a, b))


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
@pytest.mark.parametrize("config", [
    dict(num_layers=1),
    dict(num_layers=2, bidirectional=True),
    dict(num_layers=2, batch_first=True, bias=False),
], ids=["1-layer", "2-layer-bidirectional", "batch_first-no-bias"])
def test_matches_torch(ours, theirs, config):
    module, reference = twins(ours, theirs, input_size=7, hidden_size=10, **config)
    shape = (3, 5, 7) if config.get("batch_first") else (5, 3, 7)
    x = torch.randn(shape)
    directions = 2 if config.get("bidirectional") else 1
    h0 = torch.randn(config["num_layers"] * directions, 3, 10)
    hx = (h0, torch.randn_like(h0)) if theirs is torch.nn.LSTM else h0
    with torch.no_grad():
        y, final = module(x, hx)
        y_ref, final_ref = reference(x, hx)
    assert y.shape == y_ref.shape and close(y, y_ref) and close(final, final_ref)


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
def test_packed_variable_lengths_match_torch(ours, theirs):
    module, reference = twins(ours, theirs, input_size=4, hidden_size=6, num_layers=2, bidirectional=True)
    lengths = torch.tensor([6, 2, 4, 1])
    packed = pack_padded_sequence(torch.randn(6, 4, 4), lengths, enforce_sorted=False)
    with torch.no_grad():
        y, final = module(packed)
        y_ref, final_ref = reference(packed)
    (y, got), (y_ref, want) = pad_packed_sequence(y), pad_packed_sequence(y_ref)
    assert torch.equal(got, want) and close(y, y_ref) and close(final, final_ref)


def test_any_cell_runs_as_a_module():
    module = halstm.nn.RNN(halstm.ResetBeforeGRU, 5, 8).eval()
    x = torch.randn(4, 2, 5)
    with torch.no_grad():
        y, h = module(x)
    params = {n: getattr(module, n + "_l0").detach().numpy() for n in module.cell.parameters()}
    y_ref, final = halstm.reference(module.cell, x.numpy(), params)
    assert rel_err(y.numpy(), y_ref) < 1e-5 and rel_err(h[0].numpy(), final["h"]) < 1e-5


def test_torch_compile_traces_around_the_op():
    module = halstm.nn.GRU(6, 8, num_layers=2).eval()
    x = torch.randn(5, 3, 6)
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    with torch.no_grad():
        y, h = compiled(x)
        y_eager, h_eager = module(x)
    assert torch.equal(y, y_eager) and torch.equal(h, h_eager)


def test_gradients_are_refused_clearly():
    module = halstm.nn.LSTM(3, 4)
    with pytest.raises(NotImplementedError, match="forward only"):
        module(torch.randn(2, 1, 3))
    with pytest.raises(ValueError, match=r"hx\['h'\]: expected shape \(1, 1, 4\)"):
        with torch.no_grad():
            module(torch.randn(2, 1, 3), (torch.zeros(2, 1, 4), torch.zeros(2, 1, 4)))


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="no CUDA device")
@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
def test_matches_cudnn_on_a_side_stream(ours, theirs, monkeypatch):
    """On the GPU, on a non-default stream: the kernels must run on torch's current stream, or the
    output would be read before it is written. cuDNN in full fp32 (no TF32) to compare at 1e-5."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    module, reference = twins(ours, theirs, input_size=32, hidden_size=48, num_layers=2, bidirectional=True)
    module, reference = module.cuda(), reference.cuda()
    x = torch.randn(20, 4, 32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(stream):
        y, final = module(x)
        y_ref, final_ref = reference(x)
        y, y_ref = y.cpu(), y_ref.cpu()  # copies on the same stream, ordered after the kernels
    stream.synchronize()
    final = tuple(f.cpu() for f in final) if isinstance(final, tuple) else final.cpu()
    final_ref = tuple(f.cpu() for f in final_ref) if isinstance(final_ref, tuple) else final_ref.cpu()
    assert close(y, y_ref) and close(final, final_ref)
