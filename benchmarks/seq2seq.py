"""Seq2seq benchmark: halstm's GRU encoder-decoder (``halstm.models.seq2seq.Seq2Seq``) against the plain
PyTorch model (``TorchSeq2Seq``) on the same weights, side by side in one run: ms for the encoder over T
source tokens and ms per greedily decoded token (a decode of N tokens / N), at each batch size; medians
of runs that alternate between the two after warm-up. First checks that both decode the same tokens,
and the logits and states against the model in float64. Prints a table, writes JSON.

    python benchmarks/seq2seq.py [--device cpu|cuda] [--batches 1,32,128] [--out seq2seq.json]
                                 [--record docs/seq2seq-results.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time

# Both thread pools wait passively once their work is done: in one process on a few shared cores, a
# pool that spins starves the other (with the defaults, torch decoded 10-25x slower right after halstm
# had run, on 2 cores). Set before torch and TVM start their pools.
WAIT = {"OMP_WAIT_POLICY": "PASSIVE", "TVM_THREAD_POOL_SPIN_COUNT": "0"}
for _name, _value in WAIT.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import tvm  # noqa: E402

from halstm.bench import alternating_median_ms, save_run  # noqa: E402
from halstm.models.seq2seq import Seq2Seq, TorchSeq2Seq  # noqa: E402


def rel_err(got, want) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm())


def machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    with open("/proc/cpuinfo") as f:
        name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    return f"{name}, {torch.get_num_threads()} threads"


def bench(batch: int, a, sync) -> dict:
    torch.manual_seed(batch)
    reference = TorchSeq2Seq(a.vocab, a.embed, a.hidden, a.layers).eval().to(a.device)
    model = Seq2Seq(a.vocab, a.embed, a.hidden, a.layers).eval().to(a.device)
    model.load_state_dict(reference.state_dict())
    source = torch.randint(0, a.vocab, (a.source_len, batch), device=a.device)
    start = torch.randint(0, a.vocab, (batch,), device=a.device)
    with torch.no_grad():
        begin = time.perf_counter()
        tokens, hidden, logits = model(source, start, a.steps)  # compiles the encoder layers and the decoder
        sync()
        first_call = time.perf_counter() - begin
        want = reference(source, start, a.steps)
        want64 = copy.deepcopy(reference).double()(source, start, a.steps)
        checks = {
            "tokens equal torch": bool((tokens == want[0]).all()),
            "tokens equal float64": bool((tokens == want64[0]).all()),
            "distinct tokens": int(tokens.unique().numel()),
            "hidden rel. error": rel_err(hidden, want64[1]),
            "logits rel. error": rel_err(logits, want64[2]),
            "torch logits rel. error": rel_err(want[2], want64[2]),
        }
        f = model.compiled_decoder(a.steps, batch, source.device)  # the key decode() uses (cuda:0, not cuda)
        pack = alternating_median_ms({"pack": lambda: f.pack(model.decoder_parameters())}, sync, 1, 3)["pack"]
        context = model.encode(source)[1][-1]
        encoder = alternating_median_ms(
            {"halstm": lambda: model.encode(source), "torch": lambda: reference.encode(source)},
            sync, a.warmup, a.repeat)
        decoder = alternating_median_ms(
            {"halstm": lambda: model.decode(context, start, a.steps),
             "torch": lambda: reference.decode(context, start, a.steps)},
            sync, a.warmup, a.repeat)
    per_token = {k: v / a.steps for k, v in decoder.items()}
    return {"batch": batch, "encoder_ms": encoder, "encoder_torch_over_halstm": encoder["torch"] / encoder["halstm"],
            "decode_ms_per_token": per_token, "decode_torch_over_halstm": decoder["torch"] / decoder["halstm"],
            "pack_ms_once": pack, "first_call_s": first_call, "checks": checks}


def table(result: dict) -> str:
    lines = ["| B | encoder halstm ms | encoder torch ms | torch / halstm | decode halstm ms/token | "
             "decode torch ms/token | torch / halstm | tokens equal | logits rel. error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        e, d, c = r["encoder_ms"], r["decode_ms_per_token"], r["checks"]
        lines.append(f"| {r['batch']} | {e['halstm']:.1f} | {e['torch']:.1f} | {r['encoder_torch_over_halstm']:.2f}x | "
                     f"{d['halstm']:.2f} | {d['torch']:.2f} | {r['decode_torch_over_halstm']:.2f}x | "
                     f"{c['tokens equal torch'] and c['tokens equal float64']} | {c['logits rel. error']:.1e} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--embed", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2, help="encoder layers")
    p.add_argument("--source-len", type=int, default=50, help="T, source tokens the encoder reads")
    p.add_argument("--steps", type=int, default=20, help="N, tokens decoded")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default="seq2seq.json", help="this run's JSON")
    p.add_argument("--record", help="a JSON list of runs to append this one to (docs/seq2seq-results.json)")
    a = p.parse_args()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    result = {"date": time.strftime("%Y-%m-%d"), "device": a.device, "machine": machine(a.device),
              "torch": torch.__version__, "tvm": tvm.__version__, "env": {k: os.environ[k] for k in WAIT},
              "config": {k: getattr(a, k) for k in ("vocab", "embed", "hidden", "layers", "source_len", "steps",
                                                    "warmup", "repeat")},
              "rows": []}
    for batch in (int(b) for b in a.batches.split(",")):
        result["rows"].append(bench(batch, a, sync))
        print(json.dumps(result["rows"][-1]), flush=True)
    print(table(result))
    save_run(result, a.out, a.record)


if __name__ == "__main__":
    main()
