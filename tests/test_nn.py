"""halstm.nn against torch.nn on the same state_dict: layers, directions, batch_first, lengths;
outputs and the gradients with respect to the input, the initial states and every parameter."""

import functools
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

import halstm  # noqa: E402
import halstm.nn  # noqa: E402
from halstm.gradients import reference_backward  # noqa: E402
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


def backward(output, final):
    """Backpropagate a loss with random weights on the output and the final states (the same weights
    for both modules: the generator is seeded per call)."""
    generator = torch.Generator().manual_seed(0)
    tensors = [output] + list(final if isinstance(final, tuple) else (final,))
    sum((t * torch.randn(t.shape, generator=generator).to(t.device)).sum() for t in tensors).backward()


def same_gradients(module, reference, *inputs):
    """Every parameter's gradient, and each input's, as torch's (each input used by one module)."""
    pairs = [(p.grad, q.grad) for (_, p), (_, q) in zip(module.named_parameters(), reference.named_parameters())]
    pairs += [(a.grad, b.grad) for a, b in inputs]
    return all(rel_err(a.cpu().numpy(), b.cpu().numpy()) < 1e-5 for a, b in pairs)


def leaf(t):
    return t.clone().requires_grad_()


# The tests share sizes (I=20, H=10, T=5, B=3), so that they share compiled functions: I = 2H, the second
# layer's input width (two directions), so that one cell a module (with bias) is compiled, forward and backward.
@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
@pytest.mark.parametrize("config", [
    dict(num_layers=1),
    dict(num_layers=2, bidirectional=True),
    dict(num_layers=2, bidirectional=True, batch_first=True, bias=False),
], ids=["1-layer", "2-layer-bidirectional", "batch_first-no-bias"])
def test_matches_torch(ours, theirs, config):
    module, reference = twins(ours, theirs, input_size=20, hidden_size=10, **config)
    shape = (3, 5, 20) if config.get("batch_first") else (5, 3, 20)
    x = torch.randn(shape)
    directions = 2 if config.get("bidirectional") else 1
    h0 = torch.randn(config["num_layers"] * directions, 3, 10)
    hx = (h0, torch.randn_like(h0)) if theirs is torch.nn.LSTM else (h0,)
    x1, x2, hx1, hx2 = leaf(x), leaf(x), [leaf(h) for h in hx], [leaf(h) for h in hx]
    y, final = module(x1, tuple(hx1) if len(hx1) > 1 else hx1[0])
    y_ref, final_ref = reference(x2, tuple(hx2) if len(hx2) > 1 else hx2[0])
    assert y.shape == y_ref.shape and close(y, y_ref) and close(final, final_ref)
    backward(y, final)
    backward(y_ref, final_ref)
    assert same_gradients(module, reference, (x1, x2), *zip(hx1, hx2))


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
def test_packed_variable_lengths_match_torch(ours, theirs):
    module, reference = twins(ours, theirs, input_size=20, hidden_size=10, num_layers=2, bidirectional=True)
    lengths = torch.tensor([5, 2, 4])
    x = torch.randn(5, 3, 20)
    x1, x2 = leaf(x), leaf(x)
    y, final = module(pack_padded_sequence(x1, lengths, enforce_sorted=False))
    y_ref, final_ref = reference(pack_padded_sequence(x2, lengths, enforce_sorted=False))
    (y, got), (y_ref, want) = pad_packed_sequence(y), pad_packed_sequence(y_ref)
    assert torch.equal(got, want) and close(y, y_ref) and close(final, final_ref)
    backward(y, final)
    backward(y_ref, final_ref)
    assert same_gradients(module, reference, (x1, x2))


def test_any_cell_runs_and_trains_as_a_module():
    module = halstm.nn.RNN(halstm.ResetBeforeGRU, 5, 8)
    x = torch.randn(4, 2, 5, requires_grad=True)
    y, h = module(x)
    params = {n: getattr(module, n + "_l0").detach().numpy().astype("float64") for n in module.cell.parameters()}
    y_ref, final = halstm.reference(module.cell, x.detach().numpy(), params)
    assert rel_err(y.detach().numpy(), y_ref) < 1e-5 and rel_err(h[0].detach().numpy(), final["h"]) < 1e-5
    gy = torch.randn_like(y)
    y.backward(gy)
    grads = {"h": np.concatenate([np.zeros((1, 2, 8)), gy.numpy()]).astype("float64")}
    dx, dparams, _ = reference_backward(module.cell, x.detach().numpy(), params, None, grads)
    assert rel_err(x.grad.numpy(), dx) < 1e-5
    assert all(rel_err(getattr(module, n + "_l0").grad.numpy(), d) < 1e-5 for n, d in dparams.items())


def test_torch_compile_traces_around_the_op():
    module = halstm.nn.GRU(20, 10, num_layers=2, bidirectional=True).eval()
    x = torch.randn(5, 3, 20)
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    with torch.no_grad():
        y, h = compiled(x)
        y_eager, h_eager = module(x)
    assert torch.equal(y, y_eager) and torch.equal(h, h_eager)


def test_torch_compile_traces_the_backward():
    """AOT autograd traces the backward op through its fake implementation (aot_eager: no codegen)."""
    module = halstm.nn.GRU(20, 10)
    x = torch.randn(5, 3, 20)
    y, _ = torch.compile(module, backend="aot_eager", fullgraph=True)(x)
    y.sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    module(x)[0].sum().backward()
    assert all(torch.allclose(g, p.grad) for g, p in zip(grads, module.parameters()))


def test_second_derivatives_are_refused_not_silently_wrong():
    module, x = halstm.nn.LSTM(3, 4), torch.randn(5, 2, 3, requires_grad=True)
    y, _ = module(x)
    dx, = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        dx.sum().backward()


def test_bad_initial_state_is_named():
    module = halstm.nn.LSTM(3, 4)
    with pytest.raises(ValueError, match=r"hx\['h'\]: expected shape \(1, 1, 4\)"):
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


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="no CUDA device")
@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
def test_gradients_match_cudnn_on_a_side_stream(ours, theirs, monkeypatch):
    """Training on the GPU, on a non-default stream: the gradients as cuDNN's (full fp32)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    module, reference = twins(ours, theirs, input_size=32, hidden_size=48, num_layers=2, bidirectional=True)
    module, reference = module.cuda().train(), reference.cuda().train()  # cuDNN's backward needs training mode
    x = torch.randn(20, 4, 32, device="cuda")
    x1, x2 = leaf(x), leaf(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        backward(*module(x1))
        backward(*reference(x2))
    stream.synchronize()
    assert same_gradients(module, reference, (x1, x2))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="no CUDA device")
@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LSTM", "GRU"])
def test_tf32_training_matches_float64(ours, theirs):
    """allow_tf32: forward and backward on TF32 tensor cores (the reversed loop in the persistent
    kernel at this shape), gradients within TF32's tolerance of the same model in float64."""
    module, reference = twins(lambda **k: ours(**k, allow_tf32=True), theirs, input_size=256, hidden_size=256)
    module, reference = module.cuda().train(), reference.double().cuda().train()
    x = torch.randn(20, 16, 256, device="cuda")
    x1, x2 = leaf(x), leaf(x.double())
    backward(*module(x1))
    backward(*reference(x2))
    pairs = [(p.grad, q.grad) for p, q in zip(module.parameters(), reference.parameters())] + [(x1.grad, x2.grad)]
    assert all(rel_err(a.cpu().double().numpy(), b.cpu().numpy()) < 1e-3 for a, b in pairs)


def test_allow_tf32_modules_compile_apart():
    """An allow_tf32 module and an exact one of the same cell never share compiled functions."""
    exact, tf32 = halstm.nn.LSTM(20, 10), halstm.nn.LSTM(20, 10, allow_tf32=True)
    assert "allow_tf32=True" in repr(tf32) and "allow_tf32" not in repr(exact)
    x = torch.randn(5, 3, 20)
    tf32.load_state_dict(exact.state_dict())
    assert close(exact(x)[0], tf32(x)[0])  # the CPU has no TF32: both exact
    keys = {k[1] for k in halstm.nn._COMPILED}
    assert {exact._layers[0][0], tf32._layers[0][0]} <= keys and exact._layers[0][0] != tf32._layers[0][0]


def test_import_halstm_gives_nn_lazily():
    """``import halstm`` loads neither torch nor TVM; ``halstm.nn`` then works without its own import."""
    code = ("import sys, halstm; heavy = {'torch', 'tvm'} & set(sys.modules); "
            "print(sorted(heavy), type(halstm.nn.LSTM(4, 8)).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["[]", "LSTM"], out.stdout + out.stderr


def test_forward_compiles_once_for_every_sequence_length(monkeypatch):
    """A bidirectional two-layer module over batches of several lengths: each layer direction's
    forward compiled once, for any T, and each length's output still torch's."""
    monkeypatch.setattr(halstm.nn, "_COMPILED", {})
    ours, theirs = twins(halstm.nn.GRU, torch.nn.GRU, input_size=6, hidden_size=8, num_layers=2,
                         bidirectional=True)
    with torch.no_grad():
        for T in (4, 9, 2, 9):
            x = torch.randn(T, 3, 6)
            assert close(ours(x)[0], theirs(x)[0]), T
    forwards = [k for k in halstm.nn._COMPILED if k[0] == "compile"]
    assert len(forwards) == len({k[1] for k in forwards}) and all(k[2] is None for k in forwards)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "tf32"])
def test_on_a_gpu_the_backward_serves_every_length(dtype, monkeypatch):
    """Training steps over several lengths on a GPU: the backward compiled once for any T in fp16,
    bf16, exact float32 and TF32 (``halstm.nn._ANY_STEPS``); gradients against torch's in float64."""
    monkeypatch.setattr(halstm.nn, "_COMPILED", {})
    ours, theirs = twins(halstm.nn.LSTM, torch.nn.LSTM, input_size=24, hidden_size=32, num_layers=2)
    if dtype == "tf32":
        ours = halstm.nn.LSTM(24, 32, num_layers=2, allow_tf32=True)
        ours.load_state_dict(theirs.state_dict())
    ours, theirs = ours.to("cuda", getattr(torch, dtype.replace("tf32", "float32"))), theirs.double()
    for T in (3, 8, 3):
        x = torch.randn(T, 4, 24, generator=torch.Generator().manual_seed(T))
        for module, inputs in ((ours, x.to("cuda", next(ours.parameters()).dtype)), (theirs, x.double())):
            module.zero_grad()
            backward(*module(inputs))
        for p, q in zip(ours.parameters(), theirs.parameters()):
            tolerance = {"float32": 1e-5, "tf32": 1e-3}.get(dtype, 1e-2)
            assert rel_err(p.grad.double().cpu().numpy(), q.grad.numpy()) < tolerance, T
    backwards = ("compile_backward", "_compile_backward_given", "_compile_backward_given_results")
    assert {k[2] for k in halstm.nn._COMPILED if k[0] in backwards} == {None}
    assert {k[2] for k in halstm.nn._COMPILED if k[0] in ("compile", "_compile_keeping")} == {None}


def test_training_recomputes_step_results_where_the_forward_recipe_keeps_none(monkeypatch):
    """A training forward whose recipe does not keep its step GEMM results (as the GPU's step loop):
    the backward takes the hoisted results alone and computes the step GEMMs again; the gradients
    still torch's."""
    from halstm.schedules import CpuStepLoop

    monkeypatch.setattr(halstm.nn, "_COMPILED", {})
    monkeypatch.setattr(CpuStepLoop, "keeps_results", False)
    ours, theirs = twins(halstm.nn.LSTM, torch.nn.LSTM, input_size=5, hidden_size=6)
    for module in (ours, theirs):
        backward(*module(torch.randn(4, 2, 5, generator=torch.Generator().manual_seed(0))))
    assert all(rel_err(p.grad.numpy(), q.grad.numpy()) < 1e-4 for p, q in zip(ours.parameters(), theirs.parameters()))
    assert sorted(k[0] for k in halstm.nn._COMPILED) == ["_compile_backward_given", "_compile_keeping"]
    assert not next(f for k, f in halstm.nn._COMPILED.items() if k[0] == "_compile_keeping").program.keeps_results


@pytest.mark.parametrize("recompute", [False, True])
def test_training_compiles_once_for_every_sequence_length(monkeypatch, recompute):
    """Training steps over several lengths on the CPU: each layer's forward and backward compiled
    once, for any T (the forward keeping its GEMM results, the backward taking them; with
    ``recompute`` the plain forward and a backward computing them again); the gradients still torch's."""
    monkeypatch.setattr(halstm.nn, "_COMPILED", {})
    ours, theirs = twins(functools.partial(halstm.nn.LSTM, recompute=recompute), torch.nn.LSTM, input_size=5,
                         hidden_size=6, num_layers=2)
    for T in (3, 8, 3):
        for module in (ours, theirs):
            module.zero_grad()
            backward(*module(torch.randn(T, 2, 5, generator=torch.Generator().manual_seed(T))))
        pairs = [(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters())]
        assert all(rel_err(a.numpy(), b.numpy()) < 1e-4 for a, b in pairs), T
    kinds = [k[0] for k in halstm.nn._COMPILED]
    expected = ["compile", "compile_backward"] if recompute else ["_compile_keeping", "_compile_backward_given_results"]
    assert sorted(kinds) == sorted(expected * 2)
    assert all(k[2] is None for k in halstm.nn._COMPILED)
