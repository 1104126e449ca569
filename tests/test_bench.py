"""The benchmark as the README's first command runs it: its timing harness and its plot."""

import os

from PIL import Image

from halstm import bench


def test_plot_is_a_small_palette_png(tmp_path):
    """Plots are committed to docs/, so they are small palette PNGs that keep the repository small:
    64 colours, not matplotlib's RGBA (a third of the bytes)."""
    rows = [bench.Row("LSTM", 100, 16, 256, 1.0, 1e-6, 5.0, 6.0, 50.0),
            bench.Row("GRU", 100, 64, 512, 1.0, 1e-6, 9.0, 8.0, None)]
    bench.plot(rows, tmp_path / "results.png")
    image = Image.open(tmp_path / "results.png")
    assert image.mode == "P" and len(image.getcolors()) <= 64


def test_each_contender_is_timed_in_a_process_of_its_own(monkeypatch):
    """halstm, torch and NumPy are each timed in a worker process of their own, with the thread count
    asked for in its environment, so that no other contender's thread pool spins while it runs."""
    asked = []
    ask = bench.Contender.ask

    def recording_ask(self, **request):
        reply = ask(self, **request)
        asked.append((self.name, request["op"], reply["pid"], self.env))
        return reply

    monkeypatch.setattr(bench.Contender, "ask", recording_ask)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    lines = []
    [row] = bench.run(["LSTM"], [(3, 2, 8)], repeat=1, seed=0, log=lines.append, threads=1)
    assert [(name, op) for name, op, _, _ in asked] == [
        ("halstm", "compile"), ("halstm", "time"), ("numpy", "time"), ("torch", "time"), ("torch", "time")]
    pids = [pid for _, _, pid, _ in asked]
    assert len(set(pids)) == 4 and pids[0] == pids[1] and os.getpid() not in pids
    assert all(env[v] == "1" for *_, env in asked for v in bench.THREAD_VARIABLES)
    # torch once waiting passively, once as OpenMP does by default (spinning): its faster time counts
    assert [env.get("OMP_WAIT_POLICY") for *_, env in asked[3:]] == ["PASSIVE", None]
    assert row.error < 1e-5 and row.halstm_ms > 0 and row.numpy_ms > 0
    assert row.torch_ms is None or row.torch_ms > 0
    assert all(env["OMP_WAIT_POLICY"] == "PASSIVE" for *_, env in asked[:4])
    assert "1 threads each" in lines[-1] and "faster time" in lines[-1]


def test_a_recorded_run_is_appended_a_line_a_row(tmp_path):
    """``save_run`` appends a run to a record that reads back as the same JSON list, a line each of
    its rows (as docs/conv-results.json keeps them)."""
    import json

    record, out = tmp_path / "record.json", tmp_path / "out.json"
    runs = [{"date": "d", "rows": [{"ms": 1.5, "impl": "halstm"}, {"ms": 2.0, "impl": "torch"}]}, {"rows": []}, {}]
    for run in runs:
        bench.save_run(run, str(out), str(record))
    assert json.loads(record.read_text()) == runs and json.loads(out.read_text()) == {}
    assert '\n  {"ms": 2.0, "impl": "torch"}\n' in record.read_text()
