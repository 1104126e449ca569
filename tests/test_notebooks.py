"""Every notebook runs top to bottom on the CPU (its code cells, in order, in one namespace), from its
own folder as Jupyter runs it, wherever pytest was started."""

import json
from pathlib import Path

import matplotlib
import pytest

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    matplotlib.use("Agg")
    monkeypatch.chdir(path.parent)
    cells = json.loads(path.read_text())["cells"]
    namespace = {"__name__": "__main__"}
    for cell in cells:
        if cell["cell_type"] == "code":
            assert not cell["outputs"], f"{path.name}: stored outputs make the repository heavy"
            exec(compile("".join(cell["source"]), f"{path.name}:{cell['id']}", "exec"), namespace)
