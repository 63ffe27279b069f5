#!/usr/bin/env bash
# Where the feature kernels' time goes on one GPU (issue 23): each set's kernels by shape on
# the demo scan (a zero background) and on a dense synthetic volume (feature_sweep.py), then
# Nsight Compute on the kernels named in PROFILE ("SET:KERNEL[:SHAPE]", replayed through the
# CUDA driver by ncu_features.py on the dense volume): sections as text, SASS stall samples
# summed by ncu_stalls.py. Results into $OUT.
#   PROFILE="hessian_s3:last_yz structure_s3:st_yz" VARIANTS=default,xf_dense,st_dense \
#     bash scripts/bench/gpu/profile_features.sh
set -u
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
nvidia-smi -L
step() { echo "== $1 ($(date +%T))"; }
for vol in scan dense; do
  step "feature_sweep on the $vol volume"
  timeout 200 python3 scripts/bench/run.py feature_sweep --size 256 --volume "$vol" \
    --only "${SETS:-hessian_s3,hessian_s1,structure_s1,structure_s3}" --passes 3 --budget 150 \
    --variants "${VARIANTS:-default,xf_dense,st_dense}" --json "$OUT/sweep-$vol.json" 2>&1 \
    | grep -v -i warn
done
i=0
for item in ${PROFILE:-hessian_s3:last_yz}; do
  IFS=: read -r set kernel shape <<< "$item"
  tag="prof$i"; i=$((i + 1))
  step "ncu $set $kernel '${shape:-}' ($tag)"
  echo "== $set $kernel '${shape:-}' ($tag)" >> "$OUT/profile.txt"
  timeout 150 ncu --clock-control none -k "regex:$kernel" --launch-skip 1 --launch-count 1 \
    --set full --import-source no -o "/tmp/$tag" -f \
    python3 scripts/bench/run.py ncu_features --set "$set" --kernel "$kernel" --dense \
    --shape "${shape:-}" --ptx "$OUT/$tag.ptx" --json "$OUT/replay.jsonl" 2>&1 \
    | grep -v "^==PROF==" | grep -v -i warn | tail -4
  ncu -i "/tmp/$tag.ncu-rep" --page details >> "$OUT/profile.txt" 2>&1
  ncu -i "/tmp/$tag.ncu-rep" --page source --print-source sass --csv \
    > "$OUT/$tag-sass.csv" 2>&1 || true
done
step "stalls"
python3 scripts/bench/run.py ncu_stalls "$OUT"/prof*-sass.csv > "$OUT/stalls.txt" 2>&1
grep -E "^==|Duration|Issue Slots Busy|Executed Ipc A|No Eligible|Theoretical Occ|Achieved Occ|Registers Per|Compute \(SM\) Thr|Memory Throughput|L1/TEX Cache Thr|DRAM Thr|Block Limit" \
  "$OUT/profile.txt" | head -120
head -60 "$OUT/stalls.txt"
exit 0
