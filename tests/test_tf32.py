"""float32 GEMMs on tensor cores as TF32 (``halstm.compile(..., allow_tf32=True)``): code generation on
the CPU machine, results against float64 on the GPU."""

import shutil

import numpy as np
import pytest

import halstm
from halstm.database import tuning_key
from halstm.targets import CudaTarget
from halstm.targets.cuda import tf32_fragments
from halstm.schedules.cuda_tensorcore import tensorize_works

from conftest import (TF32_TOLERANCE, assert_nvcc_compiles, gpu_available, random_inputs, rel_err, representative,
                      upcast)
from test_cuda_codegen import CELLS, H100, RECIPES

tensor_cores = pytest.mark.skipif(not tensorize_works(), reason="TVM's tensorize segfaults with this apache-tvm-ffi")


def _source(f) -> str:
    return f.module.mod.imports[0].inspect_source()


def test_tf32_fragments_declares_and_rounds_only_tf32_operands():
    """The 16x16x8 half operand fragments (TF32's stand-in) become precision::tf32 and each load
    into one is rounded; fp16's 16x16x16 fragments and the accumulator stay as they are."""
    source = """
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 8, float> acc[2];
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 8, half, nvcuda::wmma::row_major> a_frag[2];
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, half, nvcuda::wmma::row_major> b16[1];
  nvcuda::wmma::load_matrix_sync(a_frag[(i * 2)], (&(a_shared[((i * 640) + k)])), 40);
  nvcuda::wmma::load_matrix_sync(b16[0], (&(b_shared[k])), 24);
"""
    out = tf32_fragments(source)
    assert "fragment<nvcuda::wmma::matrix_a, 16, 16, 8, nvcuda::wmma::precision::tf32, nvcuda::wmma::row_major> a_frag[2]" in out
    assert "fragment<nvcuda::wmma::matrix_b, 16, 16, 16, half, nvcuda::wmma::row_major> b16[1]" in out
    assert "fragment<nvcuda::wmma::accumulator, 16, 16, 8, float> acc[2]" in out
    assert out.count("__float_to_tf32(") == 1
    assert ("40); for (int t = 0; t < a_frag[(i * 2)].num_elements; ++t) "
            "{ a_frag[(i * 2)].x[t] = nvcuda::wmma::__float_to_tf32(a_frag[(i * 2)].x[t]); }") in out
    assert tf32_fragments(source.replace("16, 16, 8, half", "16, 16, 16, half")).count("tf32") == 0


TF32_SHAPES = {"aligned": (3, 64, 64, 256), "ragged": (7, 17, 20, 40)}
TF32_RECIPES = [("cuda-step-loop", 2), ("cuda-persistent", 1)]


# CI: each recipe at one shape, each shape once (the step loop aligned, the persistent kernel's hoisted
# GEMM zero-padded to the tile); the other two repeat those kernels' path at the other shape (slow)
@tensor_cores
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("shape, recipe, gemms", representative(
    [(s, *r) for s in TF32_SHAPES.values() for r in TF32_RECIPES],
    [f"{name}-{r}-{g}" for name in TF32_SHAPES for r, g in TF32_RECIPES],
    ["aligned-cuda-step-loop-2", "ragged-cuda-persistent-1"]))
def test_fp32_gemms_run_as_tf32_only_when_allowed(recipe, gemms, shape, tmp_path):
    """With allow_tf32 the step loop's hoisted and step GEMMs (the persistent recipe's hoisted one;
    its step GEMM stays FFMA) are 16x16x8 TF32 mma kernels whose operand fragments are rounded to
    TF32 as they load, and nvcc compiles them; without it, or on a GPU before Ampere, no WMMA. (On an
    H100 the hoisted GEMM runs on wgmma by default: test_wgmma.py.)"""
    T, B, I, H = shape
    f = halstm.compile(halstm.LSTM(I, H), T, B, "float32", target=H100, recipe=recipe, allow_tf32=True,
                       knobs={"wgmma": False})
    assert f.program.allow_tf32 and "(TF32)" in repr(f)
    source = _source(f)
    kernels = [k for k in source.split("__global__")[1:] if "wmma::mma_sync" in k]
    assert len(kernels) == gemms
    for kernel in kernels:
        assert "fragment<nvcuda::wmma::matrix_a, 16, 16, 8, nvcuda::wmma::precision::tf32" in kernel
        assert "fragment<nvcuda::wmma::matrix_b, 16, 16, 8, nvcuda::wmma::precision::tf32" in kernel
        loads = kernel.count("load_matrix_sync(")  # 2, or more where the pipeline peels the loop
        assert loads >= 2 and kernel.count("__float_to_tf32(") == loads
    assert_nvcc_compiles(source, tmp_path)
    assert "wmma" not in _source(halstm.compile(halstm.LSTM(I, H), T, B, "float32", target=H100, recipe=recipe))
    turing = CudaTarget("sm_75", sms=40, shared_memory=64 * 1024)
    assert "wmma" not in _source(halstm.compile(halstm.LSTM(I, H), T, B, "float32", target=turing,
                                                recipe="cuda-step-loop", allow_tf32=True))


def test_tf32_records_are_their_own():
    """Tuning records with TF32 allowed have their own key; keys without it are those before it."""
    cell = halstm.LSTM(8, 8)
    plain = tuning_key(cell, 4, 2, "float32", H100)
    assert "allow_tf32" not in plain
    assert tuning_key(cell, 4, 2, "float32", H100, allow_tf32=True) == {**plain, "allow_tf32": True}


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("shape", [(8, 16, 64, 64), (7, 17, 20, 40), (20, 64, 256, 256)],
                         ids=lambda s: "T{}-B{}-I{}-H{}".format(*s))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.__name__)
def test_tf32_matches_reference_on_gpu(cell, recipe, shape, rng):
    """TF32 within its tolerance of float64, and not exact: the GEMMs did run as TF32. Exact float32
    within float32's tolerance: on a Hopper GPU the step loop runs it as three TF32 products each
    (PackedLayout.tf32x3) at the shape whose K and N wgmma tiles take (H=256), the persistent kernel
    its hoisted GEMM (``hoisted_only``)."""
    torch = pytest.importorskip("torch")
    T, B, I, H = shape
    c = cell(I, H)
    x, params, states = random_inputs(c, T, B, rng)
    to_gpu = lambda a: torch.from_numpy(np.asarray(a, np.float32)).cuda()
    args = to_gpu(x), {k: to_gpu(v) for k, v in params.items()}, {k: to_gpu(v) for k, v in states.items()}
    want_y, _ = halstm.reference(c, np.asarray(x, np.float64), upcast(params), upcast(states))
    target = CudaTarget.detect()
    errors = {}
    for tf32 in (True, False):
        f = halstm.compile(c, T, B, "float32", target=target, recipe=recipe, allow_tf32=tf32)
        y, _ = f(*args)
        errors[tf32] = rel_err(y.cpu().numpy(), want_y)
        if not tf32 and H == 256 and target.compute_capability == 90:  # the persistent kernel's hoisted GEMM
            assert f.program.layout.tf32x3 and f.program.layout.hoisted_only == (recipe == "cuda-persistent")
    assert errors[True] < TF32_TOLERANCE
    assert errors[False] < 1e-5 < errors[True]
