# Source on the GPU machine (device tool) from the repository root, after `source .device/setup.sh`:
# installs this checkout (not editable: schedules/ and targets/ map to halstm.*) and the test wheels
# carried in .wheels/ (pytest-xdist's, for the GPU tests; a run without tests may leave them behind:
# the carried tree is limited to 64 MiB) into /tmp/site, where the kit put TVM; the machine has no network.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site --upgrade . \
    $(ls .wheels/*.whl 2>/dev/null)
# The kit's apache-tvm-ffi must be the pinned one (DEVELOPERS.md): with 0.1.15.post2 TVM's tensorize
# segfaults, and every fp16/bf16 GEMM then runs off tensor cores, tests fail and timings mislead
# (session 21's run 106 on an H200). Stop here rather than measure that (from /tmp: the checkout's
# bare halstm/ would shadow the installed package).
(cd /tmp && python3 -c "from halstm.schedules.cuda_tensorcore import tensorize_works as w; exit(not w())") || {
  echo "gpu_setup.sh: Schedule.tensorize crashes with this apache-tvm-ffi: swap the kit's wheel (DEVELOPERS.md)" >&2
  return 1 2>/dev/null || exit 1; }
