# On a lent GPU node: where a `volconv run` process spends its time (scripts/bench/start.py)
# for the demo and for a 16^3 input, and each import's share (-X importtime); JSON saved under
# $OUT. (The driver's start-up calls apart, probe_start_driver.py, are in 507cc93's tree.)
#   bash scripts/bench/gpu/start.sh TAG [BEFORE]
# BEFORE: a folder holding another volconv/ and kernels/ (e.g. `git archive main`), profiled
# alternately with this checkout's in the same call (TAG-before-*, TAG-after-*).
tag="${1:-start}"
before="${2:-}"
source scripts/gpu_env.sh
# as an installed package has them: compiled modules (the node's Python may not write them)
python3 -m compileall -q volconv ${before:+"$before/volconv"}
python3 -m volconv devices --probe > /dev/null 2>&1
mkdir -p /tmp/st16
python3 -c "import numpy as np; np.save('/tmp/st16/v16.npy', np.arange(4096, dtype=np.uint8).reshape(16, 16, 16))"
sed -e 's#../data/mni152_t1_256.nii#/tmp/st16/v16.npy#' -e 's#../out/demo/{stem}.h5#/tmp/st16/out/{stem}.h5#' \
  pipelines/demo.toml > /tmp/st16/p16.toml
profile() {  # NAME PYTHONPATH PIPELINE
  PYTHONPATH="$2" python3 scripts/bench/run.py start "$3" --device nvidia --repeats 5 \
    --json "$OUT/$1.json" | tail -7 | sed "s/^/$1 /"
}
for round in 1 2; do
  if [ -n "$before" ]; then
    profile "$tag-before-demo-$round" "/tmp/site:$PWD/$before" pipelines/demo.toml
  fi
  profile "$tag-after-demo-$round" "$PYTHONPATH" pipelines/demo.toml
done
[ -z "$before" ] || profile "$tag-before-16" "/tmp/site:$PWD/$before" /tmp/st16/p16.toml
profile "$tag-after-16" "$PYTHONPATH" /tmp/st16/p16.toml
python3 -X importtime -m volconv run pipelines/demo.toml --device nvidia --overwrite \
  2> "$OUT/$tag-importtime.txt" > /dev/null
sort -t'|' -k2 -n "$OUT/$tag-importtime.txt" | tail -6
