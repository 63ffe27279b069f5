# Sourced by scripts/gpu_session.sh and scripts/bench/gpu/*.sh on a lent GPU node: register
# NVIDIA's OpenCL driver, install the carried wheels (.whl/: pyopencl and what the node's Python
# lacks) and make volconv importable.
: "${OUT:?set OUT}"
mkdir -p /etc/OpenCL/vendors
echo libnvidia-opencl.so.1 > /etc/OpenCL/vendors/nvidia.icd
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD VOLCONV_CACHE_DIR=/tmp/volconv-cache
