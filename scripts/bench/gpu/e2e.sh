#!/usr/bin/env bash
# The end-to-end figures on a lent GPU node (benchmarks/README.md, "On a GPU node"), onto the node's local
# disk, results into $OUT (6 files): the stored types made on the device checked bit for bit
# against the host's on NVIDIA; bench_e2e on the demo scan (float32, float16, uint8; runs and
# floors alternating), on 8 copies of it in one run (inputs overlapping) and on a synthetic
# 1024^3 uint8 scan to float16 (16 GiB out); where the demo's time goes, thread by thread;
# the start-up phase by phase; the codecs on every core against one. About 9 minutes.
set -u
source scripts/gpu_env.sh
local=/tmp/e2e; mkdir -p $local; df -h /tmp | tail -1; nproc
step() { echo "== $1 ($(date +%T))"; }
python3 -m volconv devices --probe > /dev/null 2>&1  # the probe cached, as a user's node has it
step "device conversion against the host's"
VOLCONV_TEST_DEVICE=nvidia timeout 60 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_convert.py > "$OUT/convert-tests.log" 2>&1; echo "tests exit $?"
tail -2 "$OUT/convert-tests.log"
step demo; timeout 120 python3 scripts/bench/run.py e2e --device nvidia --repeats 3 \
  --dtypes float32,float16,uint8 --out $local --json "$OUT/e2e-demo.json" 2>&1 | grep -v Warn
step "demo, 8 inputs in one run"; timeout 90 python3 scripts/bench/run.py e2e --device nvidia \
  --inputs 8 --repeats 2 --dtypes float32,float16 --out $local --json "$OUT/e2e-demo-8.json" \
  2>&1 | grep -v Warn
step "1024^3"; timeout 200 python3 scripts/bench/run.py e2e --device nvidia --size 1024 --repeats 2 \
  --dtypes float16 --out $local --json "$OUT/e2e-1024.json" 2>&1 | grep -v Warn
step "start-up, phase by phase"; timeout 40 python3 scripts/bench/run.py start pipelines/demo.toml \
  --device nvidia --json "$OUT/start.json" 2>&1 | grep -v Warn
step "where the demo's time goes"; timeout 40 python3 scripts/bench/run.py profile_run pipelines/demo.toml \
  --device nvidia --set "output.path=$local/prof/{stem}.h5" --json "$OUT/profile-demo.json" \
  2>&1 | grep -v Warn
step codecs; timeout 60 python3 scripts/bench/run.py compression --size 192 --codecs gzip,lzf \
  --out $local/codecs --json "$OUT/codecs.json" 2>&1 | grep -v Warn
exit 0
