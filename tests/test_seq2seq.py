"""GRU seq2seq: compiled greedy decoding and the halstm model against the plain PyTorch model on the
same weights (tokens identical, states and logits to float32 accuracy against float64); the loop's
IR; CUDA code generation (nvcc) and, on a GPU machine, the same checks there."""

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from halstm.models import decoding  # noqa: E402
from halstm.models.seq2seq import GRUDecoder, Seq2Seq, TorchSeq2Seq  # noqa: E402
from halstm.targets import CudaTarget  # noqa: E402
from conftest import TOLERANCE, gpu_available, rel_err  # noqa: E402

H100 = CudaTarget("sm_90", sms=132)


def reference(V, E, H, rng, layers=1):
    """TorchSeq2Seq in float64 with fresh random weights (float32 values), and the decoder's
    parameters by name in float32."""
    model = TorchSeq2Seq(V, E, H, layers).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy((rng.uniform(-1, 1, p.shape) / np.sqrt(H)).astype(np.float32)))
        model.tgt_embedding.weight.copy_(torch.from_numpy(rng.standard_normal((V, E)).astype(np.float32)))
    return model, {n: p.detach().float().numpy() for n, p in model.decoder_parameters().items()}


def decode_inputs(model, B, H, N, rng):
    """A context and start tokens the float64 model decodes to varied tokens (at B=1 a random
    draw now and then falls into a token that repeats itself; identical tokens would check little),
    each step's token ahead of the runner-up by more than float32 rounding can move the logits (a
    draw on the H100 had two 2.8e-7 apart, and the compiled float32 decoder took the other)."""
    for _ in range(20):
        context = (0.5 * rng.standard_normal((B, H))).astype(np.float32)
        start = rng.integers(0, model.out.out_features, B).astype(np.int32)
        with torch.no_grad():
            want = [w.numpy() for w in model.decode(torch.from_numpy(context).double(),
                                                    torch.from_numpy(start).long(), N)]
        runner_up, best = np.moveaxis(np.sort(want[2], axis=-1)[..., -2:], -1, 0)
        if len(np.unique(want[0])) > 1 and np.all(best - runner_up > 1e-4 * np.maximum(np.abs(best), 1)):
            return context, start, want
    raise AssertionError("20 random draws all decoded one repeated token or a near tie")


def assert_matches(got, want):
    tokens, hidden, logits = (np.asarray(g) for g in got)
    np.testing.assert_array_equal(tokens, want[0])
    assert rel_err(hidden, want[1]) < TOLERANCE["float32"]
    assert rel_err(logits, want[2]) < TOLERANCE["float32"]


# (V, E, H, N, B): one row; sizes that are no multiples of the SIMD width or tiles
SHAPES = [(97, 8, 16, 7, 1), (203, 12, 20, 9, 5)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "V{}-E{}-H{}-N{}-B{}".format(*s))
def test_compiled_decoding_matches_torch(shape, rng):
    V, E, H, N, B = shape
    model, params = reference(V, E, H, rng)
    context, start, want = decode_inputs(model, B, H, N, rng)
    f = decoding.compile(GRUDecoder(V, E, H), N, B)
    got = f(f.pack(params), context, context, start)
    assert [g.shape for g in got] == [(N, B), (N + 1, B, H), (N, B, V)]
    assert_matches(got, want)


def test_model_matches_torch_and_repacks_changed_weights(rng):
    """Seq2Seq on TorchSeq2Seq's state_dict: encoder outputs and states, then greedy decoding; after
    the weights change in place, the packed weights follow."""
    V, E, H, L, T, B, N = 150, 10, 24, 2, 6, 3, 8
    reference64, _ = reference(V, E, H, rng, layers=L)
    model = Seq2Seq(V, E, H, L).eval()
    model.load_state_dict(reference64.state_dict())
    source = torch.from_numpy(rng.integers(0, V, (T, B)))
    start = torch.from_numpy(rng.integers(0, V, B))
    with torch.no_grad():
        for _ in range(2):
            outputs, final = model.encode(source)
            want_outputs, want_final = reference64.encode(source)
            assert rel_err(outputs.numpy(), want_outputs.numpy()) < TOLERANCE["float32"]
            assert rel_err(final.numpy(), want_final.numpy()) < TOLERANCE["float32"]
            assert_matches(model(source, start, N), [w.numpy() for w in reference64(source, start, N)])
            for m in (model, reference64):
                m.out.weight.mul_(-1.5)


def test_context_share_is_hoisted_and_the_loop_holds_lookup_and_argmax():
    """Before the loop: context @ W^T for the input and output matmuls (K = H); each step: embedding
    @ W_e^T (K = E), h @ W_hh^T, [e, h] @ W_o^T (K = E + H, after the GRU); the embedding lookup and
    the argmax run inside the loop, feeding the next step."""
    V, E, H = 50, 8, 12
    program = decoding.lower(GRUDecoder(V, E, H), steps=4, batch=2)
    plan = program.plan
    assert [(g.name, g.depth) for g in plan.hoisted] == [("weight_ih_ctx", H), ("out_weight_ctx", H)]
    assert [[(g.name, g.depth) for g in stage] for stage in plan.stages] == [
        [("weight_ih_step", E), ("weight_hh_step", H)], [("out_weight_step", E + H)]]
    assert plan.columns["out_weight_step"] == [(0, E + H)] and plan.columns["out_weight_ctx"] == [(E + H, H)]
    loop = program.mod["main"].script().split("for t in range(4):")[1]
    assert "embedding[token_t[" in loop and 'T.sblock("logits_t_red_temp")' in loop
    assert "token_next = T.match_buffer(tokens[t * 2 + 2:" in loop


def test_bad_arguments_raise_before_running(rng):
    model, params = reference(40, 4, 8, rng)
    f = decoding.compile(GRUDecoder(40, 4, 8), 3, 2)
    weights = f.pack(params)
    context = np.zeros((2, 8), np.float32)
    with pytest.raises(TypeError, match="start"):
        f(weights, context, context, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="context"):
        f(weights, context[:1], context, np.zeros(2, np.int32))
    with pytest.raises(KeyError):
        f.pack({n: p for n, p in params.items() if n != "out_weight"})
    with pytest.raises(NotImplementedError, match="no_grad"):
        Seq2Seq(40, 4, 8).decode(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), 3)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("batch", [1, 4])
def test_generates_cuda(batch):
    """One module: the packing kernels and the step's; the argmax a reduction across a block's
    threads (warp shuffles), the logits' epilogue in the GEMM's write-back (no kernel of its own)."""
    f = decoding.compile(GRUDecoder(300, 16, 24), steps=3, batch=batch, target=H100)
    source = f.module.mod.imports[0].inspect_source()
    assert source.count("void __launch_bounds__") == source.count("__global__")
    assert "pack_kernel" in source and "__shfl_down_sync" in source
    assert " out_weight_step_ptr" not in source  # the GEMM's (B, V) result never goes to memory


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("shape", SHAPES + [(1000, 64, 96, 12, 33)], ids=lambda s: "V{}-E{}-H{}-N{}-B{}".format(*s))
def test_decoding_matches_torch_on_gpu(shape, rng):
    V, E, H, N, B = shape
    model, params = reference(V, E, H, rng)
    context, start, want = decode_inputs(model, B, H, N, rng)
    f = decoding.compile(GRUDecoder(V, E, H), N, B, target=CudaTarget.detect())
    cuda = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    got = f(f.pack({n: cuda(p) for n, p in params.items()}), cuda(context), cuda(context), cuda(start))
    assert_matches([g.cpu().numpy() for g in got], want)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
def test_model_matches_torch_on_gpu(rng):
    V, E, H, L, T, B, N = 500, 32, 64, 2, 9, 7, 10
    reference64, _ = reference(V, E, H, rng, layers=L)
    model = Seq2Seq(V, E, H, L).eval()
    model.load_state_dict(reference64.state_dict())
    model.cuda()
    source, start = rng.integers(0, V, (T, B)), rng.integers(0, V, B)
    with torch.no_grad():
        got = model(torch.from_numpy(source).cuda(), torch.from_numpy(start).cuda(), N)
        want = reference64(torch.from_numpy(source), torch.from_numpy(start), N)
    assert_matches([g.cpu().numpy() for g in got], [w.numpy() for w in want])
