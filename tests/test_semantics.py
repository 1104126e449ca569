"""Semantics as PyTorch's: the activations at the extremes (inf, 0, NaN) on the CPU and CUDA; which
parameters ``halstm.nn.RNN(..., bias=False)`` drops; problems past int32 indexing refused up front."""

import shutil

import numpy as np
import pytest
import torch
from tvm import te

import halstm
import halstm.lowering
import halstm.nn
from halstm import linear, ops, sigmoid, split, tanh
from halstm.lowering import check_sizes
from halstm.plan import make_plan
from halstm.targets import CudaTarget

from conftest import assert_nvcc_compiles, gpu_available

EXTREMES = [np.inf, -np.inf, np.nan, 89, -89, 100, -100, 1000, -1000, 0, -0.0]
ORDINARY = [0.5, -1.0, 3.0, -20.0, 88.0, -87.0, -103.0]
UNARY = ("exp", "sigmoid", "tanh", "log", "sqrt", "relu")
BINARY = ("maximum", "minimum")


class Activations(halstm.Cell):
    """Each state is one function of x; the binary ones take x and x reversed (NaN on either side)."""

    states = UNARY + BINARY
    output = "exp"

    def parameters(self):
        return {}

    def step(self, p, x, *states):
        flipped = te.compute(x.shape, lambda b, j: x[b, x.shape[1] - 1 - j], name="flipped")
        return [getattr(ops, f)(x) for f in UNARY] + [getattr(ops, f)(x, flipped) for f in BINARY]


def torch_results(values: np.ndarray) -> dict:
    x = torch.from_numpy(values)
    return {**{f: getattr(torch, f)(x) for f in UNARY}, **{f: getattr(torch, f)(x, x.flip(-1)) for f in BINARY}}


@pytest.mark.parametrize("width", [16 * 2, len(EXTREMES + ORDINARY)], ids=["vectorised", "scalar"])
def test_activations_equal_torch_at_the_extremes_on_cpu(width):
    """inf where torch has inf, 0 where it has 0 (subnormals where it has them), NaN for NaN, as
    fp32 PyTorch on the CPU; elsewhere within an ulp or two. Before, exp saturated at 1.65e38 and
    1.65e-38, and relu, maximum and minimum dropped NaN."""
    values = np.resize(np.array(EXTREMES + ORDINARY, np.float32), width)
    cell = Activations(width, width)
    f = halstm.compile(cell, 1, 2, database=False)
    _, final = f(np.broadcast_to(values, (1, 2, width)).copy(), {})
    for name, want in torch_results(values).items():
        np.testing.assert_allclose(final[name][0], want.numpy(), rtol=1e-6, atol=0, err_msg=name)


def test_reference_agrees_with_torch_at_the_extremes():
    values = np.array(EXTREMES + ORDINARY)
    cell = Activations(len(values), len(values))
    with np.errstate(all="ignore"):
        _, final = halstm.reference(cell, values[None, None], {})
    for name, want in torch_results(values).items():
        np.testing.assert_allclose(final[name][0], want.numpy(), rtol=1e-12, atol=0, err_msg=name)


H100 = CudaTarget("sm_90", sms=132)
CUDA_WIDTH = 16


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cuda_activations_compile(tmp_path):
    """The CUDA source calls expf and tanhf, and nvcc compiles it: TVM builds with --use_fast_math,
    where they are ex2.approx.ftz and tanh.approx, inf, 0 and NaN at the extremes (the GPU test)."""
    f = halstm.compile(Activations(CUDA_WIDTH, CUDA_WIDTH), 1, 2, target=H100, database=False)
    source = f.module.mod.imports[0].inspect_source()
    assert "expf(" in source and "tanhf(" in source
    assert_nvcc_compiles(source, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
def test_activations_equal_torch_at_the_extremes_on_gpu():
    """As on the CPU, but subnormals flush to zero (--use_fast_math): torch's subnormal is 0 here."""
    values = np.resize(np.array(EXTREMES, np.float32), CUDA_WIDTH)
    cell = Activations(CUDA_WIDTH, CUDA_WIDTH)
    f = halstm.compile(cell, 1, 2, target=CudaTarget.detect(), database=False)
    x = torch.from_numpy(np.broadcast_to(values, (1, 2, CUDA_WIDTH)).copy()).cuda()
    _, final = f(x, {})
    for name, want in torch_results(values).items():
        want = want.numpy()
        want = np.where(np.abs(want) < np.finfo(np.float32).tiny, 0.0, want)
        np.testing.assert_allclose(final[name][0].cpu().numpy(), want, rtol=1e-6, atol=0, err_msg=name)


class CoupledLSTM(halstm.Cell):
    """The README's custom cell: its bias is ``b``, which it does not declare."""

    states = ("h", "c")

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"w_x": (3 * H, I), "w_h": (3 * H, H), "b": (3 * H,)}

    def step(self, p, x, h, c):
        f, g, o = split(linear(x, p.w_x, p.b) + linear(h, p.w_h), 3)
        c = sigmoid(f) * c + (1.0 - sigmoid(f)) * tanh(g)
        return sigmoid(o) * tanh(c), c


class DeclaredCoupledLSTM(CoupledLSTM):
    biases = ("b",)


def test_bias_false_refuses_a_cell_that_does_not_declare_its_biases():
    """Before, bias=False dropped parameters named bias* only: CoupledLSTM silently kept b."""
    halstm.nn.RNN(CoupledLSTM, 3, 4)  # with its biases: nothing to decide
    with pytest.raises(ValueError, match=r"CoupledLSTM does not declare which parameters are biases, and its "
                                         r"1-D parameters \['b'\] may be: set `biases = \(\.\.\.\)`"):
        halstm.nn.RNN(CoupledLSTM, 3, 4, bias=False)


def test_bias_false_drops_the_declared_biases():
    """The declared biases are zero and not parameters, as torch.nn.LSTM's with bias=False."""
    module = halstm.nn.RNN(DeclaredCoupledLSTM, 3, 4, bias=False)
    assert [n for n, _ in module.named_parameters()] == ["w_x_l0", "w_h_l0"]
    x = torch.randn(5, 2, 3)
    y, (h, c) = module(x)
    params = {"w_x": module.w_x_l0, "w_h": module.w_h_l0, "b": torch.zeros(12)}
    want, final = halstm.reference(module.cell, x.numpy().astype(np.float64),
                                   {n: v.detach().numpy().astype(np.float64) for n, v in params.items()})
    for got, expected in ((y, want), (h[0], final["h"]), (c[0], final["c"])):
        np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cell, kept", [
    (halstm.LSTM, ["weight_ih", "weight_hh"]),
    (halstm.GRU, ["weight_ih", "weight_hh"]),
    (halstm.PeepholeLSTM, ["weight_ih", "weight_hh", "peep_i", "peep_f", "peep_o"]),
    (halstm.ResetBeforeGRU, ["weight_ih", "weight_hr", "weight_hz", "weight_hn"]),
], ids=lambda v: getattr(v, "__name__", "kept"))
def test_built_in_cells_declare_their_biases(cell, kept):
    module = halstm.nn.RNN(cell, 3, 4, bias=False)
    assert [n for n, _ in module.named_parameters()] == [k + "_l0" for k in kept]


def test_bias_declarations_are_checked():
    class NoVectors(halstm.Cell):
        def parameters(self):
            return {"w": (self.hidden_size, self.input_size + self.hidden_size)}

    class Misnamed(CoupledLSTM):
        biases = ("bias",)

    assert NoVectors(2, 3).bias_parameters() == ()
    with pytest.raises(ValueError, match=r"Misnamed.biases names \['bias'\], which are not among its parameters"):
        Misnamed(2, 3).bias_parameters()


# (cell, T, B, the buffer refused): each past 2^31 - 1 elements by a little
PAST_INT32 = [
    (halstm.LSTM(65536, 1), 32768, 1, r"'x' \(the input, shape \(32768, 65536\)\) would hold 2147483648"),
    (halstm.GRU(1, 21846), 32768, 1, r"'x_proj0' \(a hoisted GEMM's result, shape \(32768, 65538\)\)"),
    (halstm.LSTM(1, 16384), 65536, 2, r"'h_seq' \(a state sequence, shape \(131074, 16384\)\)"),
    (halstm.GRU(65536, 32768), 1, 1, r"'weight_ih' \(a parameter, shape \(98304, 65536\)\).*a smaller cell"),
]


@pytest.mark.parametrize("cell, steps, batch, message", PAST_INT32, ids=["x", "gates", "states", "weights"])
def test_past_int32_is_refused_before_lowering(cell, steps, batch, message, monkeypatch):
    """TVM failed deep in the build ("Literal value 2147549184 exceeds range of int32")."""
    monkeypatch.setattr(halstm.lowering, "skeleton", lambda *a, **k: pytest.fail("lowered"))
    with pytest.raises(ValueError, match=message):
        halstm.compile(cell, steps, batch, database=False)


def test_int32_limit_is_exact():
    plan = make_plan(halstm.LSTM(65536, 1))
    check_sizes(plan, 32767, 1)  # x: 2^31 - 2^16 elements
    with pytest.raises(ValueError, match="'x'"):
        check_sizes(plan, 32768, 1)
