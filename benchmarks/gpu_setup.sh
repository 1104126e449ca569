# Source from the repository root on a GPU machine where TVM 0.27 and PyTorch are importable and
# /tmp/site is on PYTHONPATH: installs this checkout (not editable: schedules/ and targets/ map to
# halstm.*) and any wheels in .wheels/ (pytest-xdist and its dependencies, for the GPU tests) into
# /tmp/site, without network access.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site --upgrade . \
    $(ls .wheels/*.whl 2>/dev/null)
# TVM 0.27's Schedule.tensorize needs apache-tvm-ffi 0.1.14.post0 (pinned in pyproject.toml): with
# 0.1.15.post2 it segfaults, every fp16/bf16 GEMM then runs off tensor cores, tests fail and timings
# mislead. Stop here rather than measure that (from /tmp: the checkout's bare halstm/ would shadow the
# installed package).
(cd /tmp && python3 -c "from halstm.schedules.cuda_tensorcore import tensorize_works as w; exit(not w())") || {
  echo "gpu_setup.sh: Schedule.tensorize crashes with this apache-tvm-ffi: install apache-tvm-ffi==0.1.14.post0 (pyproject.toml)" >&2
  return 1 2>/dev/null || exit 1; }
