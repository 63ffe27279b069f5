# Sourced by scripts/gpu_session.sh and scripts/bench/gpu/*.sh on a lent GPU node: register
# NVIDIA's OpenCL driver, install the carried wheels (.whl/: pyopencl and what the node's Python
# lacks) and make volconv importable.
: "${OUT:?set OUT}"
mkdir -p /etc/OpenCL/vendors
echo libnvidia-opencl.so.1 > /etc/OpenCL/vendors/nvidia.icd
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD VOLCONV_CACHE_DIR=/tmp/volconv-cache
# The node's Python writes no bytecode (PYTHONDONTWRITEBYTECODE=1) and its numpy came without
# any: every process would compile numpy from source as it starts. Compiled here once, what a
# run imports, as pip leaves an installed package (benchmarks/README.md, "Start-up").
python3 - <<'PY' 2>/dev/null
import compileall, sys
import h5py, numpy, pyopencl, rich.console, typer  # noqa: F401
import volconv.commands, volconv.console, volconv.run.pipeline  # noqa: F401
for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None) or ""
    if path.endswith(".py"):
        compileall.compile_file(path, quiet=2)
PY
