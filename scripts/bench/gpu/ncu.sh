# On the H100 node (after scripts/gpu_env.sh): Nsight Compute on a direct kernel
# (scripts/bench/ncu.py launches volconv's PTX through the CUDA driver: ncu does not profile
# OpenCL), each run of RUNS ("ENGINE SPLIT": tensor with TensorShape fields, or fp32): its
# sections as text and its SASS with stall samples (CSV) under $OUT, summed by ncu_stalls.py.
# Usage: RUNS="tensor: tensor:xo=2,tyw=3 fp32:" N=8 bash scripts/bench/gpu/ncu.sh
export PYTHONUNBUFFERED=1
i=0
for run in ${RUNS:-tensor:}; do
  engine=${run%%:*} split=${run#*:}
  tag="prof$i"; i=$((i + 1))
  echo "== $engine '$split' ($tag)" | tee -a "$OUT/profile.txt"
  ncu --clock-control none -k regex:"tensor_int8|bank_conv" --launch-skip 1 --launch-count 1 \
    --set full --import-source no -o "/tmp/$tag" -f \
    python3 scripts/bench/run.py ncu --engine "$engine" --n "${N:-8}" --split "$split" \
    --ptx "/tmp/$tag.ptx" 2>&1 | grep -v "^==PROF==" | tail -6 | tee -a "$OUT/profile.txt"
  ncu -i "/tmp/$tag.ncu-rep" --page details >> "$OUT/profile.txt" 2>&1
  ncu -i "/tmp/$tag.ncu-rep" --page source --print-source sass --csv \
    > "$OUT/$tag-sass.csv" 2>&1 || true
done
python3 scripts/bench/run.py ncu_stalls "$OUT"/prof*-sass.csv | tee "$OUT/stalls.txt"
grep -E "^==|Duration|Issue Slots Busy|Executed Ipc A|No Eligible|Theoretical Occ|Achieved Occ|Registers Per|Compute \(SM\) Thr|L1/TEX Cache Thr|Tensor" \
  "$OUT/profile.txt" | head -80
