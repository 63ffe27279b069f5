#!/usr/bin/env bash
# Issue 10's codec and resume figures on a lent GPU node (benchmarks/README.md, "On a GPU node"), onto the
# node's local disk, results into $OUT: the codecs on every core against one (gzip, lzf;
# float32 and float16); the writer alone at 1024^2 planes with and without resumable
# progress (CRCs, a flush and a record every slab); the 1024^3 uint8 -> 8 float16 run
# fresh (progress recorded) and with --overwrite, in turns, beside h5py's chunked write of the
# same bytes. About 4 minutes. CODECS_SIZE (192), CODECS_REPEATS (3), CODECS_ARGS (e.g.
# --no-h5py), SKIP_WRITER=1 (the writer alone not measured).
set -u
source scripts/gpu_env.sh
local=/tmp/codecs; mkdir -p $local; df -h /tmp | tail -1; nproc
step() { echo "== $1 ($(date +%T))"; }
python3 -m volconv devices --probe > /dev/null 2>&1  # the probe cached, as a user's node has it
step codecs; timeout 150 python3 scripts/bench/run.py compression --size ${CODECS_SIZE:-192} \
  --codecs gzip,lzf --repeats ${CODECS_REPEATS:-3} ${CODECS_ARGS:-} --out $local/codecs \
  --json "$OUT/codecs-${CODECS_SIZE:-192}.json" 2>&1 | grep -v Warn
if [ -z "${SKIP_WRITER:-}" ]; then
  step "writer alone, 1024^2 planes, progress"; timeout 60 python3 scripts/bench/run.py writer \
    --size 1024 --rows 128 --slab-depth 8 --dtypes float16 --stored-only --progress \
    --repeats 2 --out $local/writer --json "$OUT/writer-progress.json" 2>&1 | grep -v Warn
  rm -rf $local/writer
fi
step "1024^3 fresh and --overwrite in turns"; timeout 150 python3 scripts/bench/run.py e2e \
  --device nvidia --size 1024 --repeats ${E2E_REPEATS:-2} --alternate --floors chunked --dtypes float16 \
  --out $local/e2e --json "$OUT/e2e-1024-fresh.json" 2>&1 | grep -v Warn
rm -rf $local
exit 0
