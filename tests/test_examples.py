"""The README's example runs as shipped."""

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "custom_cell.py"


def test_readme_example_runs(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "stage 1: gemm0 = h @ [w_h]^T" in out
    error = float(out.rsplit(":", 1)[1])
    assert error < 1e-5
