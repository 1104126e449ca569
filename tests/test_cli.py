"""The ``halstm`` command as a user runs it: quick help, one-line errors with exit status 2 for a
mistake in the command line and 1 for a failure, ``--debug`` for the traceback."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import gpu_available

PROBLEM = ["--input-size", "4", "--hidden-size", "4", "--steps", "2", "--batch", "1"]
HEAVY = ("tvm", "torch", "numpy", "matplotlib")
HALSTM = str(Path(sys.executable).with_name("halstm"))  # the console script: no folder added to the import path


def halstm(*args, cwd):
    """``halstm args`` run in ``cwd``: (exit status, stdout, stderr)."""
    done = subprocess.run([HALSTM, *args], cwd=cwd, capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr


def error(args, status, cwd) -> str:
    """The one line that ``halstm args`` writes to stderr, exiting with ``status``."""
    code, _, err = halstm(*args, cwd=cwd)
    assert code == status, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("halstm: error: "), err
    return lines[0]


def heavy_modules_after(argv, cwd) -> list[str]:
    """The heavy modules that ``main(argv)`` imported, in a fresh interpreter."""
    code = (f"import json, sys\nfrom halstm.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["tune", "--help"], ["export", "--help"],
                                  ["info", "--help"]])
def test_help_imports_no_heavy_module(argv, tmp_path):
    assert heavy_modules_after(argv, tmp_path) == []


def test_help_is_quick(tmp_path):
    start = time.perf_counter()
    code, out, _ = halstm("--help", cwd=tmp_path)
    elapsed = time.perf_counter() - start
    print(f"halstm --help: {elapsed:.2f} s")
    assert code == 0 and "export" in out
    assert elapsed < 1.5


@pytest.mark.parametrize("option", ["--input-size", "--hidden-size", "--steps", "--batch"])
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_sizes_are_positive_integers(option, value, tmp_path):
    args = ["export", "--cell", "GRU", *PROBLEM, "-o", "m.so"]
    args[args.index(option) + 1] = value
    line = error(args, 2, tmp_path)
    either = " or any" if option == "--steps" else ""
    assert f"argument {option}: expected a positive integer{either}, got '{value}'" in line


def test_export_for_any_length_and_tune_refusing_it(tmp_path):
    args = ["--cell", "GRU", *PROBLEM]
    args[args.index("--steps") + 1] = "any"
    code, out, err = halstm("export", *args, "-o", "m.so", cwd=tmp_path)
    assert code == 0, err
    assert "T=any" in out and json.loads((tmp_path / "m.so.json").read_text())["signature"]["steps"] is None
    assert "tune times one sequence length" in error(["tune", *args], 2, tmp_path)


def test_info_on_a_missing_module_says_the_module_is_missing(tmp_path):
    line = error(["info", "missing.so"], 2, tmp_path)
    assert line == "halstm: error: missing.so does not exist"


@pytest.mark.skipif(gpu_available(), reason="a CUDA GPU is visible")
def test_cuda_without_a_gpu_says_what_to_pass(tmp_path):
    line = error(["export", "--cell", "GRU", *PROBLEM, "--target", "cuda", "-o", "m.so"], 1, tmp_path)
    assert "no CUDA GPU was found" in line and "--target cpu" in line


def test_an_unusable_output_path_fails_before_compiling(tmp_path):
    argv = ["export", "--cell", "GRU", *PROBLEM, "-o", "no/such/folder/m.so"]
    line = error(argv, 2, tmp_path)
    assert line == "halstm: error: -o no/such/folder/m.so: folder no/such/folder does not exist"
    assert heavy_modules_after(argv, tmp_path) == [], "it compiled first"
    (tmp_path / "file").write_text("")
    assert error(["export", "--cell", "GRU", *PROBLEM, "-o", "file/m.so"], 2, tmp_path).endswith(
        "file is not a folder")
    assert "is a folder" in error(["export", "--cell", "GRU", *PROBLEM, "-o", "."], 2, tmp_path)


def test_unknown_cells_list_the_built_in_ones(tmp_path):
    from halstm.cells import BUILTIN

    known = ", ".join(sorted(BUILTIN))
    assert known in error(["export", "--cell", "LSMT", *PROBLEM, "-o", "m.so"], 2, tmp_path)
    assert known in error(["bench", "--cells", "LSTM", "LSMT"], 2, tmp_path)
    assert "no module 'nothere'" in error(["export", "--cell", "nothere:C", *PROBLEM, "-o", "m.so"], 2, tmp_path)


def test_tune_finds_a_cell_module_in_the_current_folder(tmp_path):
    """Imported from the current folder, and measured in the tuner's worker processes too."""
    (tmp_path / "mycell.py").write_text("import halstm\n\n\nclass Mine(halstm.GRU):\n    pass\n")
    code, out, err = halstm("tune", "--cell", "mycell:Mine", *PROBLEM, "--trials", "1", "--builders", "1",
                            "--database", "db.jsonl", cwd=tmp_path)
    assert code == 0 and "best: cpu-step-loop" in out, out + err


def test_export_takes_a_cell_by_file_path(tmp_path):
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / "peephole.py").write_text("import halstm\n\n\nclass Mine(halstm.PeepholeLSTM):\n    pass\n")
    (tmp_path / "run").mkdir()
    code, out, err = halstm("export", "--cell", "../cells/peephole.py:Mine", *PROBLEM, "-o", "m.so",
                            cwd=tmp_path / "run")
    assert code == 0, err
    assert (tmp_path / "run" / "m.so").exists() and "Mine" in out


def test_an_import_error_in_a_cell_module_is_shown(tmp_path):
    (tmp_path / "broken.py").write_text("import not_a_module_xyz\n")
    line = error(["export", "--cell", "broken:Mine", *PROBLEM, "-o", "m.so"], 1, tmp_path)
    assert "ModuleNotFoundError: No module named 'not_a_module_xyz'" in line
    code, _, err = halstm("--debug", "export", "--cell", "broken:Mine", *PROBLEM, "-o", "m.so", cwd=tmp_path)
    assert code == 1
    assert "Traceback (most recent call last)" in err and 'broken.py", line 1' in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(where, tmp_path):
    args = ["--debug", "info", "missing.so"] if where == "before" else ["info", "missing.so", "--debug"]
    code, _, err = halstm(*args, cwd=tmp_path)
    assert code == 2
    assert err.startswith("Traceback (most recent call last)") and "missing.so does not exist" in err
