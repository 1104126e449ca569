#!/usr/bin/env bash
# Checks the CUDA code on a GPU and times it, in stages that each fit a few minutes. From the repository
# root on the GPU machine, with TVM 0.27 and PyTorch importable:
#
#   source benchmarks/gpu_setup.sh && bash benchmarks/device_check.sh [stage...]
#
# Stages (default: all, in this order), each writing into $OUT:
#   tests   every GPU test and the slow ones CI leaves out
#           (pytest -m "gpu or slow", 12 workers)                           pytest.log       ~3 min (H100, -m gpu)
#   sweep   the wgmma tiles (and WMMA) of the fp16 step loop; TF32 and exact
#           fp32 against WMMA and FFMA; cuDNN                                sweep-*.md/json  (not timed whole)
#   table   benchmarks/gpu.py on its shapes, fp16, TF32, fp32                 results.*        ~3 min (H100)
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
      timeout 600 python3 -m pytest -q -n 12 -m "gpu or slow" -p no:cacheprovider -p no:timeout t/ > "$out/pytest.log" 2>&1
      tail -1 "$out/pytest.log" ;;
    sweep)  # the wgmma tiles against auto's (wgmma.py), and WMMA with its own defaults; TF32 and exact fp32
      for case in "LSTM 100,256,1024 float16" "LSTM 100,64,2048 float16" "GRU 100,256,1024 float16"; do
        python3 b/knob_sweep.py $case --knobs '{"wgmma_step":"1x64x4"}' '{"wgmma_step":"1x128x6f"}' \
          '{"wgmma_hoisted":"2x128x5f"}' '{"wgmma":false}' --out "$out" 2>&1 | grep "^|"
      done
      for case in "LSTM 100,64,1024 tf32" "LSTM 100,256,1024 float32"; do  # wgmma against WMMA, 3xTF32 against FFMA
        python3 b/knob_sweep.py $case --knobs '{"wgmma":false}' '{"tensor_cores":false}' --out "$out" 2>&1 | grep "^|"
      done
      python3 b/knob_sweep.py ResetBeforeGRU 100,256,1024 float16 --knobs '{"wgmma":false}' --out "$out" 2>&1 | grep "^|" ;;
    table)
      timeout 420 python3 b/gpu.py --dtypes float16,tf32,float32 --no-compile --out "$out" > "$out/gpu.log" 2>&1
      tail -40 "$out/gpu.log" ;;
    *) echo "unknown stage $stage (tests, sweep, table)"; exit 2 ;;
  esac
done
