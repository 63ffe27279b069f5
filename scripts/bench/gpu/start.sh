# On a lent GPU node: a `volconv run` process against its in-run wall (scripts/bench/start.py),
# this checkout against BEFORE alternately, for the demo and a 16^3 input; JSON under $OUT.
#   bash scripts/bench/gpu/start.sh TAG [BEFORE]
# BEFORE: a folder holding another volconv/ and kernels/, carried as untracked files, e.g.
#   mkdir before && git archive 9fe3bc2 volconv kernels | tar -x -C before
# Needs .whl/ and data/mni152_t1_256.nii carried. Prints each tree's medians (process, in-run
# walls, process - first input's wall, process - run's wall, the report's start) and the
# largest imports. Two more trees, this checkout changed: `late` without the driver started
# first thing (volconv.cli._start_driver): whether that start pays on this node; `pinned32`
# with slab buffers of at most 32 MiB, not 128 (run/memory.py MAX_PINNED_BYTES): whether
# page-locking less at a time pays.
tag="${1:-start}"
before="${2:-}"
source scripts/gpu_env.sh
rm -rf /tmp/late && mkdir -p /tmp/late && cp -r volconv kernels /tmp/late/
sed -i 's/^    _start_driver(sys.argv\[1:\])$/    pass  # the driver starts with the run command/' \
  /tmp/late/volconv/cli.py
grep -q "the driver starts with the run command" /tmp/late/volconv/cli.py || echo "late: not made"
rm -rf /tmp/pinned32 && mkdir -p /tmp/pinned32 && cp -r volconv kernels /tmp/pinned32/
sed -i 's/^MAX_PINNED_BYTES = 128 \* 2\*\*20$/MAX_PINNED_BYTES = 32 * 2**20/' /tmp/pinned32/volconv/run/memory.py
grep -q "^MAX_PINNED_BYTES = 32 " /tmp/pinned32/volconv/run/memory.py || echo "pinned32: not made"
# as an installed package has them: compiled modules (the node's Python may not write them)
python3 -m compileall -q volconv /tmp/late/volconv /tmp/pinned32/volconv ${before:+"$before/volconv"} > /dev/null
python3 -m volconv devices --probe > /dev/null 2>&1  # the probe cached, as a user's node has it
mkdir -p /tmp/st16
python3 -c "import numpy as np; np.save('/tmp/st16/v16.npy', np.arange(4096, dtype=np.uint8).reshape(16, 16, 16))"
sed -e 's#../data/mni152_t1_256.nii#/tmp/st16/v16.npy#' -e 's#../out/demo/{stem}.h5#/tmp/st16/out/{stem}.h5#' \
  pipelines/demo.toml > /tmp/st16/p16.toml
for case in demo:pipelines/demo.toml 16:/tmp/st16/p16.toml; do
  echo "== ${case%%:*}"
  timeout 290 python3 scripts/bench/run.py start "${case#*:}" --device nvidia --repeats 7 \
    ${before:+--before "$before"} --tree late=/tmp/late \
    --tree pinned32=/tmp/pinned32 --json "$OUT/$tag-${case%%:*}.json"
done
