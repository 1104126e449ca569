"""Several GPUs. halstm.nn inside torch DistributedDataParallel, launched with torchrun: two ranks' gradients equal
one process's gradients of the two shares' concatenated batch, eager and under torch.compile; on
the CPU (gloo) and on two GPUs (NCCL, with NVLink multicast off). And a module on the second GPU
gives what it gives on the first. The tuner measures candidates on every GPU at once."""

import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import halstm.nn  # noqa: E402
from conftest import rel_err  # noqa: E402

RANKS = pathlib.Path(__file__).with_name("ddp_ranks.py")
# B: the whole batch, two shares of two; I = H: the two layers are one cell, compiled once (halstm.nn shares
# a cell's functions between layers), in each rank and here
T, B, I, H = 6, 4, 8, 8


def two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


needs_two_gpus = [pytest.mark.gpu, pytest.mark.skipif(not two_gpus(), reason="needs two CUDA GPUs")]


@pytest.mark.parametrize("device, compiled", [
    ("cpu", False),
    pytest.param("cpu", True, marks=pytest.mark.slow),
    pytest.param("cuda", False, marks=needs_two_gpus),
    pytest.param("cuda", True, marks=needs_two_gpus),
], ids=["cpu", "cpu-compiled", "cuda", "cuda-compiled"])
def test_two_ranks_gradients_equal_one_process_of_the_whole_batch(tmp_path, device, compiled):
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    model = halstm.nn.LSTM(I, H, num_layers=2).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5)
    x, dy, dh = torch.randn(T, B, I), torch.randn(T, B, H), torch.randn(B, H)
    torch.save({"device": device, "sizes": (I, H), "state_dict": {k: v.cpu() for k, v in model.state_dict().items()},
                "x": x, "dy": dy, "dh": dh}, tmp_path / "case.pt")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "OMP_NUM_THREADS": "1",
           "HALSTM_CACHE_DIR": str(tmp_path / "cache")}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(RANKS),
              str(tmp_path / "case.pt"), str(tmp_path)] + ["--compile"] * compiled
    done = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    y, (h, _) = model(x.to(device))
    ((y * dy.to(device)).mean() + (h * dh.to(device)).mean()).backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, p in model.named_parameters():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # DDP leaves every rank the same gradients
        assert rel_err(ranks[0][name].numpy(), p.grad.cpu().numpy()) < 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs two CUDA GPUs")
def test_a_module_on_the_second_gpu_matches_the_first():
    """cuda:1 while cuda:0 is torch's current device: the kernels run on the tensors' device, on its stream."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    first = halstm.nn.LSTM(I, H, num_layers=2).cuda(0)
    second = halstm.nn.LSTM(I, H, num_layers=2).cuda(1)
    second.load_state_dict(first.state_dict())
    x, dy = torch.randn(T, B, I), torch.randn(T, B, H)
    grads = []
    for model, device in ((first, "cuda:0"), (second, "cuda:1")):
        xs = x.to(device).requires_grad_()
        y, _ = model(xs)
        y.backward(dy.to(device))
        assert y.device == torch.device(device) and xs.grad.device == torch.device(device)
        grads.append([y.detach().cpu(), xs.grad.cpu(), *(p.grad.cpu() for p in model.parameters())])
    assert torch.cuda.current_device() == 0
    for a, b in zip(*grads):
        assert rel_err(a.numpy(), b.numpy()) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs two CUDA GPUs")
def test_tuning_measures_on_every_gpu(tmp_path):
    from halstm.tuner import tune

    lines = []
    best = tune(halstm.cells.LSTM(16, 32), 8, 4, "float32", "cuda", database=tmp_path / "db.jsonl", trials=8,
                gpus="all", log=lines.append)
    assert best is not None and best.ms > 0
    measured = [line for line in lines if line.startswith("|")]
    assert len(measured) == 8
    assert {"GPU 0", "GPU 1"} <= {line.split("] ")[1][:5] for line in measured}, "\n".join(measured)
