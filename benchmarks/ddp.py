"""halstm.nn under torch DistributedDataParallel: a language model trained on 1 and on several GPUs.

The model is an embedding, a 2-layer LSTM and a linear layer to the vocabulary, trained on next-token
cross entropy over synthetic tokens from a fixed sparse Markov chain (each token has ``--branching``
successors, so the loss falls from ln(vocab) towards ln(branching)). It runs with the LSTM as
``halstm.nn.LSTM`` and as ``torch.nn.LSTM`` (cuDNN) from the same initial state_dict and the same
tokens, each launched with torchrun on 1 and on N GPUs (one process a GPU, NCCL, ``--batch`` sequences
a GPU); it prints samples/s, the scaling over 1 GPU and how far halstm's loss curve is from cuDNN's.
float32 runs with TF32 GEMMs on both sides (cuDNN's default; ``allow_tf32=True`` for halstm).

    python benchmarks/ddp.py --gpus 1,2                      # B=64 a GPU, H=1024, T=128
    python benchmarks/ddp.py --gpus 1,2 --compile            # torch.compile of the DDP-wrapped model
    python benchmarks/ddp.py --device cpu --gpus 1,2 --tiny  # gloo on the CPU: a smoke test of this script

Each launch sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (NVLink multicast off) in its
processes. Writes results.json and results.md into --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

import halstm.nn

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
SETTINGS = ("device", "batch", "hidden", "length", "layers", "vocab", "branching", "dtype", "steps", "warmup", "lr",
            "seed")  # what a launch passes on to its processes
RNNS = {"halstm": halstm.nn.LSTM, "cudnn": lambda *a, allow_tf32, **k: torch.nn.LSTM(*a, **k)}


class LanguageModel(torch.nn.Module):
    """Embedding -> LSTM (``rnn``: "halstm" or "cudnn") -> linear to the vocabulary."""

    def __init__(self, rnn: str, vocab: int, hidden: int, layers: int, allow_tf32: bool):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.lstm = RNNS[rnn](hidden, hidden, layers, batch_first=True, allow_tf32=allow_tf32)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens):
        """Mean next-token cross entropy over ``tokens`` (B, T + 1)."""
        y, _ = self.lstm(self.embedding(tokens[:, :-1]))
        logits = self.head(y)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def markov_tokens(seed: int, vocab: int, branching: int, batches: int, batch: int, steps: int) -> np.ndarray:
    """``batches`` batches of ``batch`` sequences of ``steps`` tokens from the chain fixed by ``seed``
    (each token's ``branching`` successors equally likely); the sequences drawn from ``seed`` too, so
    that every launch sees the same tokens."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, (vocab, branching))
    tokens = np.empty((batches, batch, steps), np.int64)
    tokens[..., 0] = rng.integers(0, vocab, (batches, batch))
    for t in range(1, steps):
        tokens[..., t] = successors[tokens[..., t - 1], rng.integers(0, branching, (batches, batch))]
    return tokens


def train(args) -> None:
    """One process of a launch (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE): trains, and rank 0
    writes the losses and the timing to ``--result``."""
    os.environ.update(NO_MULTICAST)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)  # the same initial weights on every rank and for both RNNs
    reference = LanguageModel("cudnn", args.vocab, args.hidden, args.layers, False)
    model = LanguageModel(args.rnn, args.vocab, args.hidden, args.layers, args.tf32)
    model.load_state_dict(reference.state_dict())
    model = model.to(device=device, dtype=dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    step = torch.compile(ddp) if args.compile else ddp
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    count = args.warmup + args.steps
    tokens = markov_tokens(args.seed, args.vocab, args.branching, count * world, args.batch, args.length + 1)
    tokens = torch.from_numpy(tokens[rank::world]).to(device)  # this rank's share of each global batch
    losses = []

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    started = time.perf_counter()
    for i in range(count):
        if i == args.warmup:
            sync()
            timed = time.perf_counter()
            compile_s = timed - started
        loss = step(tokens[i])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    sync()
    seconds = time.perf_counter() - timed
    curve = torch.stack(losses).float()
    dist.all_reduce(curve)  # each step's loss over the global batch
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"losses": (curve / world).tolist(), "seconds": seconds, "compile_s": compile_s,
                       "samples_per_s": args.steps * args.batch * world / seconds}, f)
    dist.barrier()
    del step, ddp  # the reducer holds the process group: it goes first (tests/ddp_ranks.py says why)
    gc.collect()
    dist.destroy_process_group()


def launch(args, rnn: str, gpus: int, folder: str) -> dict | None:
    """Train with ``rnn`` on ``gpus`` processes (torchrun): rank 0's results and the launch's exit
    status, None where rank 0 wrote none."""
    result = os.path.join(folder, f"{rnn}-{gpus}.json")
    settings = [f"--{name}={getattr(args, name)}" for name in SETTINGS]
    flags = ["--no-tf32"] * (not args.tf32) + ["--compile"] * args.compile
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
               os.path.abspath(__file__), "--train", "--rnn", rnn, "--result", result, *settings, *flags]
    env = {**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        status = subprocess.run(command, env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        status = "timed out"
    if not os.path.exists(result):
        print(f"{rnn} on {gpus}: no result (exit status {status})", flush=True)
        return None
    with open(result) as f:
        return {**json.load(f), "status": status}


def report(args, results: dict) -> str:
    lines = [f"LSTM language model, {args.layers} layers, H={args.hidden}, vocabulary {args.vocab}, T={args.length}, "
             f"B={args.batch} a GPU, {args.dtype}{' (TF32)' if args.tf32 and args.dtype == 'float32' else ''}"
             f"{', torch.compile' if args.compile else ''}; {args.steps} steps timed after {args.warmup}, SGD",
             "", f"| RNN | GPUs | samples/s | over {args.gpus_list[0]} | vs cuDNN | first step s | loss: first, last | max loss gap to cuDNN | exit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (rnn, gpus), r in results.items():
        if r is None:
            continue
        one, cudnn = results.get((rnn, args.gpus_list[0])) or r, results.get(("cudnn", gpus))
        gap = max(abs(a - b) for a, b in zip(r["losses"], cudnn["losses"])) if cudnn else math.nan
        lines.append(f"| {rnn} | {gpus} | {r['samples_per_s']:.0f} | "
                     f"{r['samples_per_s'] / one['samples_per_s']:.2f}x |"
                     f" {r['samples_per_s'] / cudnn['samples_per_s'] if cudnn else math.nan:.2f}x | {r['compile_s']:.1f} | "
                     f"{r['losses'][0]:.3f}, {r['losses'][-1]:.3f} | {gap:.2e} | {r['status']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1,2", help="process counts to launch, e.g. 1,2 (GPUs, or CPU processes)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rnns", default="cudnn,halstm")
    p.add_argument("--batch", type=int, default=64, help="sequences a process")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--length", type=int, default=128, help="T")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--branching", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--no-tf32", dest="tf32", action="store_false", help="exact float32 GEMMs on both sides")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the DDP-wrapped model")
    p.add_argument("--tiny", action="store_true", help="a small model and few steps")
    p.add_argument("--timeout", type=float, default=900, help="seconds a launch may take")
    p.add_argument("--out", default="ddp-results")
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # a launched process
    p.add_argument("--rnn", choices=tuple(RNNS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tiny:
        args.batch, args.hidden, args.length, args.vocab, args.steps, args.warmup = 4, 32, 16, 64, 20, 2
    if args.train:
        return train(args)
    args.gpus_list = [int(g) for g in args.gpus.split(",")]
    if args.device == "cuda" and max(args.gpus_list) > torch.cuda.device_count():
        p.error(f"--gpus {args.gpus}: {torch.cuda.device_count()} CUDA devices are visible")
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="halstm-ddp-") as folder:
        for gpus in args.gpus_list:
            for rnn in args.rnns.split(","):
                results[rnn, gpus] = r = launch(args, rnn, gpus, folder)
                if r:
                    print(f"{rnn} on {gpus}: {r['samples_per_s']:.0f} samples/s, exit status {r['status']}", flush=True)
    text = report(args, results)
    print(text)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({f"{rnn}-{gpus}": r for (rnn, gpus), r in results.items()}, f, indent=1)
    if any(r is None or r["status"] != 0 for r in results.values()):
        sys.exit("a launch failed (its exit status is in the table)")


if __name__ == "__main__":
    main()
