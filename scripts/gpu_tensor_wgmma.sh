# On the H100 node (after scripts/gpu_env.sh): the INT8 engine on wgmma against mma.sync: ptxas's
# report and SASS counts of the 7^3 builds (N = 8 and 16, one or two outputs along x per step),
# the wgmma tests on the GPU, then the benchmark (its sweep holds the wgmma splits); results
# under $OUT. Usage: bash scripts/gpu_tensor_wgmma.sh TAG [bench args...]
tag=$1; shift
export PYTHONUNBUFFERED=1
sass="$OUT/h100-tensor-$tag-sass.txt"
: > "$sass"
builds=("--n 8 --wgmma 1" "--n 8 --wgmma 2 --xo 4 --tyw 2 --persistent 3"
        "--n 16 --wgmma 2 --xo 2 --tyw 2 --persistent 3")
for build in "${builds[@]}"; do
  echo "== $build" >> "$sass"
  # shellcheck disable=SC2086
  python3 scripts/tensor_ptx.py $build --out /tmp/k.ptx >> "$sass" 2>&1 || continue
  if ptxas -arch=sm_90a -v /tmp/k.ptx -o /tmp/k.cubin >> "$sass" 2>&1; then
    cuobjdump -sass /tmp/k.cubin > /tmp/k.sass
    grep -oE '^\s+/\*[0-9a-f]+\*/\s+[A-Z][A-Z0-9_.]+' /tmp/k.sass | awk '{print $2}' | sort \
      | uniq -c | sort -rn | head -16 >> "$sass"
  fi
done
grep -m1 -E '^\.(version|target)' /tmp/k.ptx >> "$sass"
VOLCONV_TEST_DEVICE=nvidia timeout "${TEST_TIMEOUT:-100}" python3 -m pytest tests/test_tensor.py \
  -q -p no:cacheprovider -k "${TEST_K:-wgmma}" > "$OUT/h100-tensor-$tag-tests.log" 2>&1
tail -3 "$OUT/h100-tensor-$tag-tests.log"
timeout "${BENCH_TIMEOUT:-170}" python3 scripts/bench_tensor.py --device nvidia \
  --json "$OUT/h100-tensor-$tag.json" "$@" 2>&1 | grep -v -i warning | tee "$OUT/h100-tensor-$tag.log"
grep -E '^==|registers|warning|error|MMA|GMMA' "$sass" | head -60
