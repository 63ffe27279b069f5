# On a lent GPU node: where a `volconv run` process of the demo spends its time
# (scripts/profile_start.py) and each import's share (-X importtime), saved under $OUT.
source scripts/gpu_env.sh
python3 -m volconv devices --probe > /dev/null 2>&1
python3 scripts/profile_start.py pipelines/demo.toml --device nvidia --json "$OUT/start.json"
python3 -X importtime -m volconv run pipelines/demo.toml --device nvidia --overwrite \
  2> "$OUT/importtime.txt" > /dev/null
sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -12
python3 -c "import typer, numpy, h5py, nibabel; print(typer.__version__, numpy.__version__, h5py.__version__, nibabel.__version__)"
