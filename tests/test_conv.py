"""Lightweight and dynamic convolution against the plain PyTorch reference (fairseq's unfold): values
and autograd gradients, compiled in float64 (to rounding) and float32 (1e-5); the modules, their
state_dict and torch.library registration; the CPU recipe's rewrites; CUDA code generation (nvcc) and,
on a GPU machine (``-m gpu``), CUDA results."""

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from halstm.models import conv  # noqa: E402
from halstm.models.conv_reference import dynamic_conv, lightweight_conv  # noqa: E402
from halstm.models.conv_torch import RECIPES, DynamicConv1d, LightweightConv1d, compiled  # noqa: E402
from halstm.models.op import compile_op  # noqa: E402
from halstm.targets import CudaTarget  # noqa: E402

from conftest import TOLERANCE, gpu_available, rel_err, representative  # noqa: E402

# (T, B, C, K, H, padding_l): causal and centred, K from 3 to 31, heads of 4 channels (less than a
# SIMD vector) and of 16, rows that do not fill a register tile
SHAPES = [(7, 3, 12, 3, 3, 2), (20, 2, 32, 31, 2, 15), (9, 5, 64, 7, 4, 6)]
IDS = ["K3-causal-R4", "K31-centred-R16", "K7-causal-R16"]


def random_layer(layer: conv.ConvLayer, rng, dtype=torch.float64):
    """x, parameters (fairseq's shapes squeezed) and dy, none of them zero."""
    T, B, C, K, H = layer.steps, layer.batch, layer.channels, layer.kernel_size, layer.heads
    new = lambda *shape, scale=1.0: torch.tensor(scale * rng.standard_normal(shape), dtype=dtype)  # noqa: E731
    if layer.dynamic:
        params = {"weight_linear": new(H * K, C, scale=C ** -0.5), "bias_linear": new(H * K), "bias": new(C)}
    else:
        params = {"weight": new(H, K), "bias": new(C)}
    return new(T, B, C), params, new(T, B, C)


def reference(layer, x, params, grad):
    """y and the gradients of <y, grad> by name, from the plain PyTorch layer in float64."""
    leaves = {n: t.double().requires_grad_() for n, t in {"x": x, **params}.items()}
    if layer.dynamic:
        y = dynamic_conv(leaves["x"], leaves["weight_linear"], leaves["bias_linear"], leaves["bias"],
                         layer.heads, layer.padding_l, layer.weight_softmax)
    else:
        y = lightweight_conv(leaves["x"], leaves["weight"], leaves["bias"], layer.padding_l, layer.weight_softmax)
    grads = torch.autograd.grad(y, list(leaves.values()), grad.double())
    return y.detach(), {f"d{n}": g for n, g in zip(leaves, grads)}


def compiled_pass(layer, x, params, grad, device="cpu"):
    """y and the gradients from the compiled forward and backward functions."""
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    forward, backward = compiled(layer, False, torch.device(device)), compiled(layer, True, torch.device(device))
    out = forward(rows(x), *params.values())
    if layer.dynamic:
        grads = backward(rows(x), out["kernel"], params["weight_linear"], rows(grad))
    else:
        grads = backward(rows(x), params["weight"], rows(grad))
    grads["dx"] = grads["dx"].view(x.shape)
    return out["y"].view(x.shape), grads


VARIANTS = [(d, k, s) for d in ("float64", "float32") for k in (False, True) for s in (True, False)]
REFERENCE_CASES = [(*v, shape) for v in VARIANTS for shape in SHAPES]
REFERENCE_IDS = [f"{d}-{'dynamic' if k else 'lightweight'}-{'softmax' if s else 'plain'}-{i}"
                 for d, k, s in VARIANTS for i in IDS]
# CI: each dtype x kind x softmax once, the shapes in turn (each kind and each dtype at every shape); the
# other shapes repeat a variant's path at other sizes (slow)
REFERENCE_IN_CI = [REFERENCE_IDS[3 * n + n % 3] for n in range(len(VARIANTS))]


@pytest.mark.parametrize("dtype, dynamic, softmax, shape", representative(REFERENCE_CASES, REFERENCE_IDS, REFERENCE_IN_CI))
def test_matches_reference(dtype, dynamic, softmax, shape, rng):
    layer = conv.ConvLayer(*shape, weight_softmax=softmax, dynamic=dynamic, dtype=dtype)
    x, params, grad = random_layer(layer, rng, getattr(torch, dtype))
    want_y, want = reference(layer, x, params, grad)
    y, got = compiled_pass(layer, x, params, grad)
    tolerance = 1e-12 if dtype == "float64" else TOLERANCE["float32"]
    assert rel_err(y, want_y) < tolerance
    assert set(got) == set(want)
    for name in want:
        assert rel_err(got[name], want[name]) < tolerance, name


# fairseq's parameter names -> the reference's
REFERENCE_NAMES = {"weight": "weight", "bias": "bias", "weight_linear.weight": "weight_linear",
                   "weight_linear.bias": "bias_linear", "conv_bias": "bias"}


def random_module(dynamic: bool, rng, **options):
    """A module (C=16, K=5, H=4) with random parameters loaded through its state_dict, fairseq's names."""
    module = (DynamicConv1d if dynamic else LightweightConv1d)(16, 5, num_heads=4, **options)
    state = {n: torch.tensor(rng.standard_normal(p.shape), dtype=torch.float32) for n, p in module.state_dict().items()}
    module.load_state_dict(state)
    return module


@pytest.mark.parametrize("dynamic, options", [
    (False, dict(padding_l=4, weight_softmax=True, bias=True)),
    (False, dict(weight_softmax=False)),
    (True, dict(padding_l=4, weight_softmax=True, bias=True, conv_bias=True)),
    (True, dict(weight_softmax=True)),
], ids=["lightweight-causal-softmax-bias", "lightweight-centred", "dynamic-causal-biases", "dynamic-centred"])
def test_module_matches_reference(dynamic, options, rng):
    module = random_module(dynamic, rng, **options)
    x = torch.tensor(rng.standard_normal((6, 3, 16)), dtype=torch.float32, requires_grad=True)
    grad = torch.tensor(rng.standard_normal((6, 3, 16)), dtype=torch.float32)
    y = module(x)
    y.backward(grad)
    layer = conv.ConvLayer(6, 3, 16, 5, 4, module.padding_l, module.weight_softmax, dynamic)
    params = {REFERENCE_NAMES[n]: p.detach() for n, p in module.named_parameters()}
    params.setdefault("bias", torch.zeros(16))
    if dynamic:
        params.setdefault("bias_linear", torch.zeros(20))
    else:
        params["weight"] = params["weight"].squeeze(1)  # fairseq's (H, 1, K)
    want_y, want = reference(layer, x.detach(), params, grad)
    assert rel_err(y.detach(), want_y) < 1e-5 and rel_err(x.grad, want["dx"]) < 1e-5
    for name, p in module.named_parameters():
        want_grad = want["d" + REFERENCE_NAMES[name]]
        assert rel_err(p.grad.reshape(want_grad.shape), want_grad) < 1e-5, name


def test_ops_are_registered_for_autograd_and_fake_tensors(rng):
    x = torch.tensor(rng.standard_normal((5, 2, 8)), dtype=torch.float32, requires_grad=True)
    weight = torch.tensor(rng.standard_normal((2, 3)), dtype=torch.float32, requires_grad=True)
    bias = torch.tensor(rng.standard_normal(8), dtype=torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.halstm.lightweight_conv.default, (x, weight, bias, 2, True))


def test_bad_sizes_and_options_raise():
    with pytest.raises(ValueError, match="multiple of heads"):
        LightweightConv1d(10, 3, num_heads=4)
    with pytest.raises(ValueError, match="padding_l"):
        DynamicConv1d(8, 3, padding_l=3, num_heads=2)
    with pytest.raises(NotImplementedError, match="weight_dropout"):
        LightweightConv1d(8, 3, num_heads=2, weight_dropout=0.1)
    with pytest.raises(ValueError, match="dtype"):
        LightweightConv1d(8, 3, num_heads=2)(torch.zeros(4, 2, 8, dtype=torch.float16))


def test_cpu_recipe_starts_sums_from_their_bias_and_packs_gemm_operands():
    """dx's taps start from dx through the Linear (no block adds them afterwards), the output bias
    is the taps' initial value, the Linear's weight is read in contiguous column strips."""
    layer = conv.ConvLayer(8, 2, 32, 8, 2, 7, dynamic=True)  # the Linear: 32 -> 16
    backward = compile_op(conv.backward_program(layer), "cpu", RECIPES).schedule.mod.script()
    assert 'T.sblock("dx")' not in backward and "dx_local[v_m, v_c] = dx_linear[v_m, v_c]" in backward
    forward = compile_op(conv.forward_program(layer), "cpu", RECIPES).schedule.mod.script()
    assert "y_local[v_m, v_c] = bias[v_c]" in forward
    assert "weight_linear_global = T.sblock_alloc_buffer((1, 32, 16))" in forward


H100 = CudaTarget("sm_90", sms=132)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("dynamic", [False, True], ids=["lightweight", "dynamic"])
def test_generates_cuda(dynamic):
    layer = conv.ConvLayer(*SHAPES[2], dynamic=dynamic)
    for program in (conv.forward_program(layer), conv.backward_program(layer)):
        f = compile_op(program, H100, RECIPES)
        assert f.recipe.name == "cuda-conv" and "__global__" in f.module.mod.imports[0].inspect_source()


def test_cuda_recipe_prunes_what_the_gpu_cannot_run():
    """A GPU of 256 threads a block: the 128 x 128 GEMM tile of 4 x 4 a thread (1024 threads) and
    512-thread blocks are out; the defaults and the rest of the space stay."""
    recipe = next(r for r in RECIPES if r.name == "cuda-conv")
    program = conv.forward_program(conv.ConvLayer(*SHAPES[2]))
    small = CudaTarget("sm_80", sms=8, max_threads=256)
    default = recipe.defaults(program, small)
    assert recipe.valid(program, small, default) and recipe.valid(program, H100, default)
    assert not recipe.valid(program, small, {**default, "gemm_block": 128, "gemm_thread": 4})
    assert not recipe.valid(program, small, {**default, "threads": 512})
    assert recipe.valid(program, H100, {**default, "threads": 512, "gemm_block": 128, "gemm_thread": 4})
    assert 0 < len(recipe.space(program, small)) < len(recipe.space(program, H100))


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("dynamic", [False, True], ids=["lightweight", "dynamic"])
def test_matches_reference_on_gpu(dynamic, shape, rng):
    layer = conv.ConvLayer(*shape, weight_softmax=True, dynamic=dynamic)
    x, params, grad = random_layer(layer, rng, torch.float32)
    want_y, want = reference(layer, x, params, grad)
    y, got = compiled_pass(layer, x.cuda(), {n: p.cuda() for n, p in params.items()}, grad.cuda(), "cuda")
    assert rel_err(y.cpu(), want_y) < 1e-5
    for name in want:
        assert rel_err(got[name].cpu(), want[name]) < 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
def test_modules_train_on_gpu(rng):
    module = random_module(True, rng, padding_l=4, weight_softmax=True, bias=True, conv_bias=True)
    module = module.cuda()
    x = torch.tensor(rng.standard_normal((6, 3, 16)), dtype=torch.float32, device="cuda", requires_grad=True)
    module(x).square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters()) and x.grad.abs().sum() > 0
    assert np.isfinite(x.grad.cpu().numpy()).all()
