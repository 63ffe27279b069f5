# On the H100 node (after scripts/gpu_env.sh): the FP32 kernel's coefficient and input-load
# variants (FILT_CONST, IN_WORDS) in one call: sweeps with SASS op counts, a default chosen
# from them, and the engine's GPU tests with that default. Results under $OUT.
export PYTHONUNBUFFERED=1
P='null,null,null'
# A. 7^3: every variant at N = 8 with its SASS, block shapes, and the narrow banks.
PYOPENCL_NO_CACHE=1 timeout 100 python3 scripts/sweep_fp32_gpu.py --device nvidia --repeats 15 \
  --ns 8,1,4,2 --sass --json "$OUT/h100-fp32const-sweep7.json" --locals '{"8":[[32,4]],"1":[[32,4]],"4":[[32,4]],"2":[[32,4]]}' \
  --points '{"8":[[8,1,2,1,0],[8,1,2,0,0],[8,1,2,2,0],[8,1,-1,2,0],[8,1,0,2,0],[8,1,2,1,4],[8,1,2,1,8],[8,1,2,2,4],[8,1,2,2,8],[4,2,null,2,0],[4,2,null,2,4],[16,1,2,2,8],[8,2,null,2,8],[]],
 "1":[[8,4,null,2,0],[8,4,null,1,4],[8,4,null,2,4],[8,4,null,2,8],[16,2,null,2,8],[]],
 "4":[['"$P"',2,0],['"$P"',2,4],[]], "2":[['"$P"',2,0],['"$P"',2,4],[]]}' \
  2>&1 | grep -v -i "warning\|lambda: self" > "$OUT/h100-fp32const-sweep7.log"
tail -45 "$OUT/h100-fp32const-sweep7.log"
# B. other extents: the plan's blocks with the old and new coefficient / input reads.
for k in 3 5 9; do
  PYOPENCL_NO_CACHE=1 timeout 35 python3 scripts/sweep_fp32_gpu.py --device nvidia --repeats 10 \
    --ns 8,1 --extent $k --samples 100 --locals '{"8":[[32,4]],"1":[[32,4]]}' --json "$OUT/h100-fp32const-k$k.json" \
    --points '{"8":[['"$P"',1,0],['"$P"',2,0],['"$P"',1,4],['"$P"',2,4]],"1":[['"$P"',1,0],['"$P"',2,0],['"$P"',1,4],['"$P"',2,4]]}' \
    2>&1 | grep "^N=" | tee -a "$OUT/h100-fp32const-extents.log"
done
# C. the default: the (filt, in_words) of the plan's blocks fastest over every bank measured
# (geometric mean against the old reads), exact everywhere; written into plan.py for the tests.
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/h100-fp32const-choice.txt"
import json, math, re, sys
from pathlib import Path
pts = []
for f in sorted(Path(sys.argv[1]).glob("h100-fp32const-*.json")):
    pts += [p for p in json.loads(f.read_text())["points"] if "ms_min" in p]
shape = lambda p: (p["extent"], p["n"], *(str(p["plan"][k]) for k in ("unroll", "rows", "row_unroll", "local_size")))
cfg = lambda p: (p["plan"]["filt_local"] or p["plan"]["filt_const"], p["plan"]["filt_const"], p["plan"]["in_words"])
base = {}  # the faster of repeated old points
for p in pts:
    if cfg(p) == (True, False, 0) and p["ms_min"] < base.get(shape(p), {"ms_min": 1e9})["ms_min"]:
        base[shape(p)] = p
best, score = (False, 0), 1.0
for fc in (False, True):
    for w in (0, 4, 8):
        pairs = [(p, base[shape(p)]) for p in pts if cfg(p) == (True, fc, w) and shape(p) in base]
        ok = all(p["all_written"] and (p["err_over_tol"] or 0) <= 1 for p, _ in pairs)
        if not pairs or (fc, w) == (False, 0):
            continue
        g = math.exp(sum(math.log(p["ms_min"] / b["ms_min"]) for p, b in pairs) / len(pairs))
        worst = max(p["ms_min"] / b["ms_min"] for p, b in pairs)
        print(f"FILT_CONST={int(fc)} IN_WORDS={w}: {len(pairs)} banks, exact {ok}, time / old: "
              f"geomean {g:.4f}, worst {worst:.4f}", [f"k{p['extent']}N{p['n']}:{p['ms_min'] / b['ms_min']:.3f}" for p, b in pairs])
        if ok and len(pairs) >= 6 and g < score - 0.01 and worst < 1.03:
            best, score = (fc, w), g
print("chosen", best)
plan = Path("volconv/plan.py")
s = re.sub(r"^GPU_FILT_CONST = \w+", f"GPU_FILT_CONST = {best[0]}", plan.read_text(), flags=re.M)
s = re.sub(r"^GPU_IN_WORDS = \d+", f"GPU_IN_WORDS = {best[1]}", s, flags=re.M)
plan.write_text(s)
PY
grep -n "^GPU_FILT_CONST\|^GPU_IN_WORDS" volconv/plan.py
VOLCONV_TEST_DEVICE=nvidia timeout $((215 - SECONDS)) python3 -m pytest tests/test_engine.py tests/test_nonfinite.py -q \
  -p no:cacheprovider -x > "$OUT/h100-fp32const-tests.log" 2>&1
tail -3 "$OUT/h100-fp32const-tests.log"
