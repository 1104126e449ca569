# Source on the GPU machine (device tool) from the repository root, after `source .device/setup.sh`:
# installs this checkout (not editable: schedules/ and targets/ map to halstm.*) and the test wheels
# carried in .wheels/ (pytest-xdist's, for the GPU tests; a run without tests may leave them behind:
# the carried tree is limited to 64 MiB) into /tmp/site, where the kit put TVM; the machine has no network.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site --upgrade . \
    $(ls .wheels/*.whl 2>/dev/null)
