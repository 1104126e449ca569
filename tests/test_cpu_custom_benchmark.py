"""benchmarks/cpu_custom.py: custom cells' CPU forward, each contender timed in a process of its own."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import cpu_custom  # noqa: E402


def test_contenders_alternate_and_torch_waits_both_ways(monkeypatch):
    """Each round runs halstm (OpenMP passive), then torch.compile and eager torch, each with OpenMP's
    default waiting and passive, the faster counting; a row gives each one's median of its rounds and
    the first round's first call."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    runs, ms = [], iter(range(1, 100))

    def in_process(cell, shape, name, env):
        runs.append((name, env.get("OMP_WAIT_POLICY")))
        return {"ms": float(next(ms)), "first s": 5.0 if name == "torch.compile" else 1.0}

    monkeypatch.setattr(cpu_custom, "in_process", in_process)
    row = cpu_custom.row("PeepholeLSTM", (5, 2, 16), 2, 2)
    one_round = [("halstm", "PASSIVE"), ("torch.compile", None), ("torch.compile", "PASSIVE"),
                 ("torch eager", None), ("torch eager", "PASSIVE")]
    assert runs == one_round * 2
    assert row["halstm rounds"] == [1.0, 6.0] and row["halstm"] == 3.5
    assert row["torch.compile rounds"] == [2.0, 7.0] and row["torch eager rounds"] == [4.0, 9.0]
    assert row["torch.compile first s"] == 5.0 and row["halstm first s"] == 1.0
    assert "| PeepholeLSTM | (5,2,16) | 3.50 | 4.50 | 6.50 | 1.29x | 1.0, 5.0 |" in cpu_custom.table([row])


def test_every_contender_matches_float64():
    """halstm, the torch loop and torch.compile of it give the cell's float64 output at CHECK."""
    errors = cpu_custom.check("ResetBeforeGRU")
    assert set(errors) == set(cpu_custom.CONTENDERS)
    assert all(e < cpu_custom.TOLERANCE for e in errors.values()), errors
