#!/bin/bash
# The FP32 kernel's loop over filter rows (ROLL) against today's defaults on the H100, one
# device call: 7^3 at N = 1, 2, 4, 8, 16, then 3^3, 5^3, 9^3, 11^3 at N = 1 and 8, then the
# GPU tests of the register blocks. Usage: scripts/gpu_fp32_roll.sh OUTDIR TAG
set -u
out=$1; tag=$2
sweep() { PYOPENCL_NO_CACHE=1 python3 scripts/sweep_fp32_gpu.py --device nvidia --sass "$@"; }
L='{"1":[[32,4]],"2":[[32,4]],"4":[[32,4]],"8":[[32,4]],"16":[[32,4]]}'
P7='{"8":[[],[8,1,2,1,1,8],[8,1,1,1,1,8],[4,2,1,1,1,8],[4,2,2,1,1,8],
          [8,2,1,1,1,4],[8,2,2,1,1,4],[8,2,-1,1,1,4],[4,4,1,1,1,4],[4,4,4,1,1,4],[4,4,2,1,1,4],
          [16,1,1,1,1,4],[8,4,1,1,1,2],[4,4,1,1,1,2],[8,2,1,0,1,4]],
     "1":[[],[8,4,1,1,1],[8,4,4,1,1],[8,4,2,1,1],[8,4,-1,1,1],[16,4,1,1,1],[8,8,1,1,1],
          [4,8,1,1,1],[16,2,1,1,1],[32,2,1,1,1]],
     "2":[[],[8,4,1,1,1],[4,4,1,1,1],[8,2,1,1,1],[16,2,1,1,1]],
     "4":[[],[8,2,1,1,1],[8,2,2,1,1],[4,4,1,1,1],[16,1,1,1,1]],
     "16":[[],[4,1,1,1,1],[2,2,1,1,1],[4,1,2,0,0]]}'
sweep --ns 8,1,2,4,16 --extent 7 --points "$P7" --locals "$L" --json $out/$tag-k7.json
R8='{"8":[[8,2,1,1,1,4],[8,2,2,1,1,4],[4,4,1,1,1,4],[8,1,2,1,0,8]]}'
sweep --ns 8 --extent 7 --points "$R8" --locals "$L" --options -cl-nv-maxrregcount=128 \
  --json $out/$tag-k7-r128.json
PX='{"8":[[],[8,1,-1,1,0,8],[8,1,2,1,0,8],[8,1,1,1,1,8],[8,2,1,1,1,4],[8,2,2,1,1,4],
          [4,4,1,1,1,4]],
     "1":[[],[8,4,1,1,1],[8,4,4,1,1],[8,8,1,1,1],[16,4,1,1,1]]}'
for k in 3 5 9 11; do
  sweep --ns 8,1 --extent $k --points "$PX" --locals "$L" --json $out/$tag-k$k.json
done
VOLCONV_TEST_DEVICE=nvidia timeout 120 python3 -m pytest -q -x tests/test_engine.py \
  -k register_blocks 2>&1 | tail -5
