#!/bin/bash
# The FP32 kernel with its input planes staged in local memory (bank_conv.cl's INPUT_LOCAL)
# against the kernel without on the H100, one device call, every point exact
# (scripts/sweep_fp32_gpu.py --sass; its PTX kept): 7^3 at N = 8 (one or two tiles,
# prefetch, work-groups, blocks, the register cap), 1, 2, 4, 13; 3^3, 5^3, 9^3, 11^3 at
# N = 8, 1, 2, 4; then (with "tests") the GPU tests. Every sweep's JSON goes into one file
# (the device tool brings back at most 8).
# Usage: scripts/gpu_fp32_tile.sh OUTDIR TAG [tests]
set -u
out=$1; tag=$2; tmp=/tmp/tile-json; mkdir -p $tmp
sweep() { PYOPENCL_NO_CACHE=1 timeout 150 python3 scripts/sweep_fp32_gpu.py --device nvidia --sass "$@"; }
C='"options":["-cl-nv-maxrregcount=128"]'
P7="{\"8\":[[],{\"tile\":true},{\"tile\":true,$C},
          {\"tile\":2,\"define\":{\"TILE_PREFETCH\":0},$C},{\"tile\":1},{\"tile\":1,$C},
          {\"tile\":true,\"roll\":1,\"row_unroll\":1,$C},{\"tile\":1,\"roll\":1,\"row_unroll\":1,$C},
          {\"tile\":true,\"row_unroll\":1,$C},{\"tile\":true,\"local\":[16,8],$C},
          {\"tile\":1,\"local\":[16,8],$C},{\"tile\":true,\"unroll\":4,\"rows\":2,$C},
          {\"tile\":true,\"roll\":1,\"row_unroll\":2,$C}],
     \"1\":[[],{\"tile\":true}], \"2\":[[],{\"tile\":0},{\"tile\":true}],
     \"4\":[[],{\"tile\":0},{\"tile\":true}], \"13\":[[],{\"tile\":0},{\"tile\":true}]}"
sweep --ns 8,1,2,4,13 --extent 7 --points "$P7" --json $tmp/k7.json --ptx $out/$tag-ptx.tar.gz
PX='{"8":[[],{"tile":0},{"tile":true}],"1":[[],{"tile":0},{"tile":true}],
     "2":[[],{"tile":0},{"tile":true}],"4":[[],{"tile":0},{"tile":true}]}'
for k in 3 5 9 11; do sweep --ns 8,1,2,4 --extent $k --points "$PX" --json $tmp/k$k.json; done
python3 - "$tmp" "$out/$tag.json" <<'PY'
import json, sys
from pathlib import Path
runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"))}
Path(sys.argv[2]).write_text(json.dumps(runs, indent=1))
PY
if [ "${3:-}" = tests ]; then
  VOLCONV_TEST_DEVICE=nvidia timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_engine.py tests/test_plan.py tests/test_tune.py 2>&1 | tail -6
fi
