# On the H100 node (after scripts/gpu_env.sh): Nsight Compute on the tensor engine's kernel
# (scripts/profile_tensor.py launches volconv's PTX through the CUDA driver: ncu does not
# profile OpenCL), each split of SPLITS: its sections as text and its SASS with stall samples
# (CSV) under $OUT. Usage: SPLITS="'' 'xo=2,tyw=3,persistent=3,wgmma=2'" bash scripts/gpu_profile_tensor.sh
export PYTHONUNBUFFERED=1
eval "splits=(${SPLITS:-"''"})"
i=0
for split in "${splits[@]}"; do
  tag="prof$i"; i=$((i + 1))
  echo "== split '$split' ($tag)" | tee -a "$OUT/profile.txt"
  ncu --clock-control none -k regex:tensor_int8 --launch-skip 1 --launch-count 1 \
    --set full --import-source no -o "/tmp/$tag" -f \
    python3 scripts/profile_tensor.py --n "${N:-8}" --split "$split" --ptx "/tmp/$tag.ptx" \
    2>&1 | grep -v "^==PROF==" | tail -6 | tee -a "$OUT/profile.txt"
  ncu -i "/tmp/$tag.ncu-rep" --page details >> "$OUT/profile.txt" 2>&1
  ncu -i "/tmp/$tag.ncu-rep" --page source --print-source sass --csv \
    > "$OUT/$tag-sass.csv" 2>&1 || true
done
python3 scripts/ncu_stalls.py "$OUT"/prof*-sass.csv | tee "$OUT/stalls.txt"
grep -E "^==|Duration|Issue Slots Busy|Executed Ipc A|No Eligible|Stall|Theoretical Occ|Achieved Occ|Registers Per|Bank Conflicts|Compute \(SM\) Thr|Tensor" \
  "$OUT/profile.txt" | head -80
