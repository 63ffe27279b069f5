source scripts/gpu_env.sh
python3 -m volconv devices --probe > /dev/null 2>&1
python3 - <<'PY'
import time
t0 = time.perf_counter()
import pyopencl as cl
t1 = time.perf_counter()
ps = cl.get_platforms()
t2 = time.perf_counter()
devs = {p.name: p.get_devices() for p in ps}
t3 = time.perf_counter()
nv = [d for p in ps for d in p.get_devices() if "NVIDIA" in p.name][0]
ctx = cl.Context([nv]); q = cl.CommandQueue(ctx)
t4 = time.perf_counter()
print(f"import pyopencl {t1-t0:.3f}  get_platforms {t2-t1:.3f}  get_devices {t3-t2:.3f} {list(devs)}  context {t4-t3:.3f}")
PY
python3 -m volconv run pipelines/demo.toml --device nvidia --overwrite > /dev/null 2>&1
for i in 1 2; do /usr/bin/time -f "%e s wall" python3 -m volconv run pipelines/demo.toml --device nvidia --overwrite 2>&1 | grep -E "wall|done"; done
python3 -X importtime -m volconv run pipelines/demo.toml --device nvidia --overwrite 2> $OUT/importtime.txt > /dev/null
sort -t'|' -k2 -n $OUT/importtime.txt | tail -8
python3 -m cProfile -o $OUT/run.prof -m volconv run pipelines/demo.toml --device nvidia --overwrite > /dev/null 2>&1
python3 -c "import pstats; pstats.Stats('$OUT/run.prof').sort_stats('cumtime').print_stats(35)" | tail -45 | cut -c1-150
