# On a lent GPU node: where a `volconv run` process spends its time (scripts/profile_start.py)
# for the demo and for a 16^3 input, each import's share (-X importtime), and with PROBE=1 the
# driver's start-up calls apart (scripts/probe_start_driver.py); JSON saved under $OUT.
#   bash scripts/gpu_profile_start.sh TAG
tag="${1:-start}"
source scripts/gpu_env.sh
python3 -m volconv devices --probe > /dev/null 2>&1
python3 scripts/profile_start.py pipelines/demo.toml --device nvidia --repeats 5 \
  --json "$OUT/$tag-demo.json" | tail -14
mkdir -p /tmp/st16
python3 -c "import numpy as np; np.save('/tmp/st16/v16.npy', np.arange(4096, dtype=np.uint8).reshape(16, 16, 16))"
sed -e 's#../data/mni152_t1_256.nii#/tmp/st16/v16.npy#' -e 's#../out/demo/{stem}.h5#/tmp/st16/out/{stem}.h5#' \
  pipelines/demo.toml > /tmp/st16/p16.toml
python3 scripts/profile_start.py /tmp/st16/p16.toml --device nvidia --repeats 5 \
  --json "$OUT/$tag-16.json" | tail -5
python3 -X importtime -m volconv run pipelines/demo.toml --device nvidia --overwrite \
  2> "$OUT/$tag-importtime.txt" > /dev/null
sort -t'|' -k2 -n "$OUT/$tag-importtime.txt" | tail -8
if [ -n "${PROBE:-}" ]; then
  OPENBLAS_NUM_THREADS=1 python3 scripts/profile_start.py pipelines/demo.toml --device nvidia \
    --repeats 5 --json "$OUT/$tag-demo-openblas1.json" | tail -5
  python3 scripts/probe_start_driver.py pipelines/demo.toml --device nvidia --json "$OUT/$tag-probe.json"
fi
nproc; python3 -c "import numpy; numpy.show_config()" 2>/dev/null | grep -i -A3 "blas" | head -8
