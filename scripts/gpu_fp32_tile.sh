#!/bin/bash
# The FP32 kernel with its input planes staged in local memory (bank_conv.cl's INPUT_LOCAL)
# on the H100, one device call (scripts/sweep_fp32_gpu.py --sass, every point exact): the
# plan's defaults against the tile forced off (or on: one tile, two) at 7^3 N = 1, 2, 4, 8, 13
# and 3^3, 5^3, 9^3, 11^3; then (with "tests") the GPU tests. Every sweep's JSON goes into one
# file (the device tool brings back at most 8). The three calls of benchmarks/README.md ran
# this script as of commits 1b700c7, 2679b75 and ec7469a (the kernel's variants TILE_PREFETCH
# and TILE_RAW, measured slower there, have since been removed).
# Usage: scripts/gpu_fp32_tile.sh OUTDIR TAG [tests]
set -u
out=$1; tag=$2; tmp=/tmp/tile-json; mkdir -p $tmp
sweep() { PYOPENCL_NO_CACHE=1 timeout 150 python3 scripts/sweep_fp32_gpu.py --device nvidia --sass "$@"; }
P7='{"8":[[],{"tile":2},{"tile":1},{"tile":1,"roll":1,"row_unroll":1}],
     "1":[[]], "2":[[],{"tile":0},{"tile":1}], "4":[[],{"tile":0},{"tile":1}],
     "13":[[],{"tile":0}]}'
sweep --ns 8,1,2,4,13 --extent 7 --points "$P7" --json $tmp/k7.json --ptx $out/$tag-ptx.tar.gz
sweep --ns 8,1 --extent 3 --points '{"8":[[]],"1":[[]]}' --json $tmp/k3.json
sweep --ns 8,1,2,4 --extent 5 --points '{"8":[[]],"1":[[]],"2":[[]],"4":[[]]}' --json $tmp/k5.json
sweep --ns 8,1,2,4 --extent 9 --points '{"8":[[]],"1":[[]],"2":[[],{"tile":0}],"4":[[]]}' \
  --json $tmp/k9.json
sweep --ns 8,1 --extent 11 --points '{"8":[[]],"1":[[]]}' --json $tmp/k11.json
python3 - "$tmp" "$out/$tag.json" <<'PY'
import json, sys
from pathlib import Path
runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"))}
Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
PY
if [ "${3:-}" = tests ]; then
  VOLCONV_TEST_DEVICE=nvidia timeout 290 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_engine.py tests/test_plan.py tests/test_tune.py 2>&1 | tail -6
fi
