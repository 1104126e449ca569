"""Variable lengths at their true cost: ``halstm.nn.LSTM`` (or GRU) on a padded batch with ``lengths``
uniform in [1, T], where each sequence stops at its own length, against the same batch without
lengths, every sequence running all T steps (the padded cost), and against torch.nn's packed sequence, in one process, forward
and forward + backward. Results are first checked against torch.nn on the packed batch.

    python benchmarks/packed.py [--device cpu|cuda] [--model LSTM] [--shape 512x64x512] [--dtype float32]
                                [--forward-only]

Prints, for each pass, the medians of alternating rounds (ms), halstm's time with lengths over its
padded time, and the share of the padded steps the lengths hold (sum of lengths / (T * B)): the
cost is true where the first is near the second. On a GPU ``halstm.nn`` runs every sequence all
T steps (``halstm.nn._BY_LENGTH``), so both of halstm's contenders are padded there.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import halstm.nn


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_rounds(contenders: dict, device, rounds: int) -> dict:
    """Median seconds of each contender over ``rounds`` rounds, the contenders alternating."""
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="LSTM", choices=("LSTM", "GRU"))
    ap.add_argument("--shape", default="512x64x512", help="TxBxH (I = H)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forward-only", action="store_true", help="skip forward + backward")
    a = ap.parse_args()
    T, B, H = map(int, a.shape.split("x"))
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.manual_seed(a.seed)
    reference = getattr(torch.nn, a.model)(H, H).to(device, dtype)
    model = getattr(halstm.nn, a.model)(H, H).to(device, dtype)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(T, B, H, device=device, dtype=dtype)
    lengths = torch.randint(1, T + 1, (B,))
    dy = torch.randn(T, B, H, device=device, dtype=dtype)
    share = lengths.sum().item() / (T * B)

    start = time.perf_counter()
    with torch.no_grad():
        y, _ = model(x, lengths=lengths)
        packed, _ = reference(pack_padded_sequence(x, lengths, enforce_sorted=False))
    want, _ = pad_packed_sequence(packed, total_length=T)
    error = ((y.double() - want.double()).norm() / want.double().norm()).item()
    print(f"{a.model} (T, B, H) = ({T}, {B}, {H}) {a.dtype} on {device}: lengths uniform in [1, {T}], "
          f"their share of the padded steps {share:.3f}; output against torch.nn packed: {error:.1e} "
          f"(first call, compiles included: {time.perf_counter() - start:.1f} s)")

    def output(inputs, lens, ours):
        """The output sequence (T, B, H): halstm's with or without lengths, torch.nn's packed or not."""
        if ours:
            return model(inputs, lengths=lens)[0]
        if lens is None:
            return reference(inputs)[0]
        return pad_packed_sequence(reference(pack_padded_sequence(inputs, lens, enforce_sorted=False))[0],
                                   total_length=T)[0]

    def forward(lens, ours):
        def run():
            with torch.no_grad():
                output(x, lens, ours)
        return run

    def training(lens, ours):
        inputs = x.clone().requires_grad_()
        return lambda: output(inputs, lens, ours).backward(dy)

    for label, make in (("forward", forward), ("forward + backward", training))[:1 if a.forward_only else 2]:
        runs = {"halstm lengths": make(lengths, True), "halstm padded": make(None, True),
                "torch.nn packed": make(lengths, False), "torch.nn padded": make(None, False)}
        for run in runs.values():  # warm-up: compiles every bucket's functions
            run()
        t = {name: v * 1e3 for name, v in timed_rounds(runs, device, a.rounds).items()}
        print(f"{label}, ms: halstm with lengths {t['halstm lengths']:.1f}, padded {t['halstm padded']:.1f} "
              f"({t['halstm lengths'] / t['halstm padded']:.2f} of it; the lengths' share {share:.2f}); "
              f"torch.nn packed {t['torch.nn packed']:.1f} (torch / halstm {t['torch.nn packed'] / t['halstm lengths']:.2f}x), "
              f"padded {t['torch.nn padded']:.1f}")


if __name__ == "__main__":
    main()
