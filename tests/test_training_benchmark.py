"""benchmarks/training_gpu.py on the CPU: each contender timed in a process of its own."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import training_gpu  # noqa: E402


def test_cpu_contenders_run_in_processes_of_their_own(tmp_path):
    """The CPU's baseline is torch.nn ("torch", not cuDNN); halstm and torch each run in a process of
    their own; a row gives each one's median and its rounds (one here: the test below alternates two)."""
    # OpenMP's waiting set: torch a process a round, not two (both ways: the test below); the module
    # cache in a folder of the test's own
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HALSTM_CACHE": "1", "HALSTM_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "training_gpu.py"), "--device", "cpu",
                           "--tiny", "--cells", "LSTM", "--rounds", "1", "--threads", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((tmp_path / "results.json").read_text())
    [row] = found["rows"]
    assert all(ok for *_, ok in found["checks"])
    assert "cuDNN" not in row and len(row["halstm rounds"]) == len(row["torch rounds"]) == 1
    assert row["halstm"] > 0 and row["torch"] > 0
    assert "| LSTM | float32 | 5 | 2 | 16 | halstm:" in (tmp_path / "results.md").read_text()


def test_torch_is_timed_waiting_both_ways_and_halstm_passively_the_contenders_alternating(monkeypatch):
    """torch runs once with OpenMP's default waiting (alone on the cores its spinning threads are
    faster) and once passive (faster where other work shares them), its faster time counting; halstm's
    process waits passively, where torch's threads would spin against TVM's pool. The contenders
    alternate, a process each a round, and a row gives each one's median of its rounds."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    runs = []
    times = {("halstm", "PASSIVE"): [3.0, 4.0], ("torch", None): [5.0, 8.0], ("torch", "PASSIVE"): [7.0, 6.0]}

    def alone(name, cell, shape, dtype, env):
        runs.append((name, env.get("OMP_WAIT_POLICY"), env["OMP_NUM_THREADS"]))
        return {name: times[name, env.get("OMP_WAIT_POLICY")].pop(0), f"{name} MB": None}

    monkeypatch.setattr(training_gpu, "_alone", alone)
    row = training_gpu.apart("LSTM", (5, 2, 16), "float32", 2, 2)
    assert runs == 2 * [("halstm", "PASSIVE", "2"), ("torch", None, "2"), ("torch", "PASSIVE", "2")]
    assert (row["halstm rounds"], row["torch rounds"]) == ([3.0, 4.0], [5.0, 6.0])
    assert (row["halstm"], row["torch"]) == (3.5, 5.5)
