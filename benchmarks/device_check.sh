#!/usr/bin/env bash
# One device call that checks the CUDA code and times it (the GPU machine has ~30 minutes a session:
# a few calls of at most 10 minutes). From the repository root on the GPU machine:
#
#   source .device/setup.sh && source benchmarks/gpu_setup.sh && bash benchmarks/device_check.sh [stage...]
#
# Stages (default: all, in this order), each writing into $OUT:
#   tests   every GPU test (pytest -m gpu, 12 workers)                      pytest.log       ~2 min
#   sweep   knob settings not yet defaults, against the defaults and cuDNN  sweep-*.md/json  (not yet timed)
#   table   benchmarks/gpu.py on issue 3's shapes, fp16 and fp32            results.*        (not yet timed)
# Run from /tmp: the bare halstm/ folder of the checkout would shadow the installed package.
set -u
out=${OUT:-$PWD/out}
mkdir -p "$out"
rm -rf /tmp/t /tmp/b && cp -r tests /tmp/t && cp -r benchmarks /tmp/b && cd /tmp || exit 1
stages=${*:-tests sweep table}
for stage in $stages; do
  echo "== $stage $(date +%T)"
  case $stage in
    tests)
      timeout 300 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider -p no:timeout t/ > "$out/pytest.log" 2>&1
      tail -1 "$out/pytest.log" ;;
    sweep)  # the 128 x 128 hoisted tile (tc_hoisted_frags=4): 282 against 340 us in ncu, never timed whole
      for shape in 100,64,1024 100,16,512; do
        python3 b/knob_sweep.py LSTM $shape float16 --recipe cuda-persistent --knobs '{"tc_hoisted_frags":4}' \
          --out "$out" 2>&1 | grep "^|"
      done
      python3 b/knob_sweep.py LSTM 100,256,1024 float16 --knobs '{"tc_hoisted_frags":4}' --out "$out" 2>&1 | grep "^|" ;;
    table)
      timeout 420 python3 b/gpu.py --dtypes float16,float32 --no-compile --out "$out" > "$out/gpu.log" 2>&1
      tail -40 "$out/gpu.log" ;;
    *) echo "unknown stage $stage (tests, sweep, table)"; exit 2 ;;
  esac
done
