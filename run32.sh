source .device/setup.sh && source benchmarks/gpu_setup.sh
rm -rf /tmp/t /tmp/b && cp -r tests /tmp/t && cp -r benchmarks /tmp/b && cd /tmp
for cell in LSTM GRU ResetBeforeGRU; do
python3 b/knob_sweep.py $cell 100,64,1024 float16 --recipe cuda-persistent --knobs '{"warp_frags":2}' '{"units":16,"row_blocks":2}' '{"units":16,"row_blocks":2,"warp_frags":4}' '{"units":16,"row_blocks":2,"warp_frags":4,"threads":512}' --reps 20 --out $OUT 2>&1 | grep "^|"
done
python3 b/knob_sweep.py LSTM 512,64,512 float16 --recipe cuda-persistent --knobs '{"warp_frags":2}' '{"units":8,"row_blocks":2,"warp_frags":2}' '{"units":8,"row_blocks":2,"warp_frags":4}' --reps 20 --out $OUT 2>&1 | grep "^|"
