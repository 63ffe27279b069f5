# On the H100 node (after scripts/gpu_env.sh): the tensor engine's SASS counts, benchmark and
# tests, results under $OUT. Usage: bash scripts/gpu_tensor_int8.sh TAG [bench args...]
# (--no-peers to leave torch and cupyx out).
tag=$1; shift
export PYTHONUNBUFFERED=1
python3 scripts/tensor_ptx.py --out "$OUT/k.ptx" > "$OUT/h100-tensor-$tag-sass.txt" 2>&1
if ptxas -arch=sm_90a -v "$OUT/k.ptx" -o /tmp/k.cubin >> "$OUT/h100-tensor-$tag-sass.txt" 2>&1; then
  cuobjdump -sass /tmp/k.cubin > /tmp/k.sass
  grep -oE '^\s+/\*[0-9a-f]+\*/\s+[A-Z][A-Z0-9_.]+' /tmp/k.sass | awk '{print $2}' | sort | uniq -c \
    | sort -rn | head -40 >> "$OUT/h100-tensor-$tag-sass.txt"
fi
rm -f "$OUT/k.ptx"
timeout "${BENCH_TIMEOUT:-260}" python3 scripts/bench_tensor.py --device nvidia \
  --json "$OUT/h100-tensor-$tag.json" "$@" 2>&1 | grep -v -i warning | tee "$OUT/h100-tensor-$tag.log"
VOLCONV_TEST_DEVICE=nvidia timeout 100 python3 -m pytest tests/test_tensor.py -q -p no:cacheprovider \
  > "$OUT/h100-tensor-$tag-tests.log" 2>&1
tail -3 "$OUT/h100-tensor-$tag-tests.log"
cat "$OUT/h100-tensor-$tag-sass.txt" | tail -42
