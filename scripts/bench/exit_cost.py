"""How long a process holding an NVIDIA OpenCL context takes to end, as its parent sees it.

    python scripts/bench/run.py exit_cost     # on a GPU node; $OUT/exit_cost.json

A child makes a context, a 256 MiB page-locked buffer and 2 GiB of device buffers, notes the
time and calls os._exit, either plainly or after forking a grandchild that closes its stdio and
ends at once (what volconv.device.driver.leave does, which also waits for its parent): the
milliseconds from that note to the parent seeing the child's pipes end and its exit, 3 each.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import os, sys, time
import numpy as np, pyopencl as cl
mode = sys.argv[1]
dev = [d for p in cl.get_platforms() if "NVIDIA" in p.name for d in p.get_devices()][0]
ctx = cl.Context([dev]); q = cl.CommandQueue(ctx)
mf = cl.mem_flags
pinned = cl.Buffer(ctx, mf.ALLOC_HOST_PTR | mf.READ_WRITE, 256 << 20)
flags = cl.map_flags.READ | cl.map_flags.WRITE
host, _ = cl.enqueue_map_buffer(q, pinned, flags, 0, (256 << 20,), np.uint8)
bufs = [cl.Buffer(ctx, mf.READ_WRITE, 512 << 20) for _ in range(4)]
cl.enqueue_copy(q, bufs[0], host); q.finish()
sys.stdout.flush(); sys.stderr.flush()
t = time.perf_counter()
print(repr(t), file=open(os.environ["EXIT_AT"], "w"))
if mode == "fork":
    if os.fork() == 0:
        for fd in (0, 1, 2):
            os.close(fd)
        os._exit(0)
os._exit(0)
"""

FOLDER = tempfile.mkdtemp(prefix="volconv-exit-")
out: dict[str, list[float]] = {}
for mode in ("plain", "fork", "plain", "fork", "plain", "fork"):
    path = os.path.join(FOLDER, f"exit_at_{mode}")  # a private folder: no planted link
    env = {**os.environ, "EXIT_AT": path}
    p = subprocess.Popen([sys.executable, "-c", CHILD, mode], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    p.communicate()
    ended = time.perf_counter()
    with open(path) as f:
        at = float(f.read())
    out.setdefault(mode, []).append(round((ended - at) * 1000, 1))
print(json.dumps(out))
with open(os.path.join(os.environ.get("OUT", "/tmp"), "exit_cost.json"), "w") as f:
    json.dump(out, f)
