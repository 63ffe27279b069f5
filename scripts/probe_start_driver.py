# ruff: noqa: E501  (the experiments run as code strings in fresh processes)
"""What a `volconv run` process's start-up costs are made of, and which of them can overlap.

    python scripts/probe_start_driver.py PIPELINE --device D [--json OUT.json]

Each experiment runs in a fresh process (the OpenCL driver starts once per process) and is
repeated; minima are kept:

- ``serial``: numpy, pyopencl, the platforms, a context, one 128 MiB pinned slab buffer
  (``ALLOC_HOST_PTR``: its creation and its mapping timed apart), as the run does them.
- ``ctypes``: the same driver calls through ctypes on pyopencl's own ICD loader (ctypes releases the GIL; pyopencl holds it for clGetPlatformIDs,
  clCreateContext and clCreateBuffer).
- ``overlap``: once numpy and pyopencl are in, those calls in a thread (through ctypes, or
  through pyopencl) while the main thread imports h5py, nibabel and volconv's modules.
- ``builds``: the pipeline's programs built from source (the driver's cache warm) and from
  their binaries, one after the other and in threads.
- ``numpy``: numpy's import with and without ``OPENBLAS_NUM_THREADS=1``.
- ``unlink``: replacing a 512 MiB file (``os.replace`` over it) against the same with a hard
  link keeping the old one alive (its blocks freed later, by ``os.unlink``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPEATS = int(os.environ.get("PROBE_REPEATS", 3))

# Each probe process starts alike: a clock, then numpy and pyopencl imported and timed.
PRELUDE = r"""
t0 = time.perf_counter()
out = {}
def mark(k):
    global t0
    t = time.perf_counter(); out[k] = t - t0; t0 = t
import numpy
mark("import numpy")
import pyopencl as cl
mark("import pyopencl")
"""

# The driver's calls through ctypes on pyopencl's own ICD loader (ctypes releases the GIL).
DRIVER = r"""
def loader():
    lib = ctypes.CDLL(next(l.split()[-1] for l in open("/proc/self/maps") if "libOpenCL" in l))
    lib.clCreateContext.restype = ctypes.c_void_p
    lib.clCreateBuffer.restype = ctypes.c_void_p
    return lib
def platforms(lib):
    n = ctypes.c_uint32()
    lib.clGetPlatformIDs(0, None, ctypes.byref(n))
    plats = (ctypes.c_void_p * n.value)()
    lib.clGetPlatformIDs(n.value, plats, None)
    return plats
def devices(lib, plats):
    devs = []
    for p in plats:
        m = ctypes.c_uint32()
        if lib.clGetDeviceIDs(ctypes.c_void_p(p), ctypes.c_uint64(0xFFFFFFFF), 0, None, ctypes.byref(m)) == 0:
            arr = (ctypes.c_void_p * m.value)()
            lib.clGetDeviceIDs(ctypes.c_void_p(p), ctypes.c_uint64(0xFFFFFFFF), m.value, arr, None)
            devs.extend(arr)
    return devs
def chosen(lib, devs):
    want, name, dev = os.environ["PROBE_DEVICE"].lower(), ctypes.create_string_buffer(256), None
    for d in devs:
        lib.clGetDeviceInfo(ctypes.c_void_p(d), ctypes.c_uint32(0x102B), ctypes.c_size_t(256), name, None)
        if want in name.value.decode().lower() or dev is None:
            dev = d
    return dev
def context(lib, dev):
    err = ctypes.c_int32()
    return lib.clCreateContext(None, 1, (ctypes.c_void_p * 1)(dev), None, None, ctypes.byref(err))
def pinned(lib, ctx):  # READ_WRITE | ALLOC_HOST_PTR, 128 MiB
    err = ctypes.c_int32()
    return lib.clCreateBuffer(ctypes.c_void_p(ctx), ctypes.c_uint64(1 | 16), ctypes.c_size_t(128 << 20), None, ctypes.byref(err))
"""

CTYPES = (
    r"""
import ctypes, glob, importlib.util, json, os, sys, threading, time
"""
    + PRELUDE
    + DRIVER
    + r"""
lib = loader()
mark("dlopen loader")
plats = platforms(lib)
mark("clGetPlatformIDs")
devs = devices(lib, plats)
mark("clGetDeviceIDs")
dev = chosen(lib, devs)
ctx = context(lib, dev)
mark("clCreateContext")
buf = pinned(lib, ctx)
mark("clCreateBuffer ALLOC_HOST_PTR 128 MiB")
cl.get_platforms()
mark("pyopencl get_platforms (after ctypes)")
c = cl.Context.from_int_ptr(ctx, retain=False)
q = cl.CommandQueue(c)
b = cl.Buffer.from_int_ptr(buf, retain=False)
mark("wrap context, queue, buffer")
a, _ = cl.enqueue_map_buffer(q, b, cl.map_flags.READ | cl.map_flags.WRITE, 0, (32 << 20,), numpy.float32)
mark("map it")
print(json.dumps(out))
"""
)

SERIAL = (
    r"""
import json, os, time
"""
    + PRELUDE
    + r"""
ps = cl.get_platforms()
mark("get_platforms")
want = os.environ["PROBE_DEVICE"].lower()
ds = [d for p in ps for d in p.get_devices()]
mark("get_devices")
dev = next((d for d in ds if want in d.name.lower() or want in d.platform.name.lower()), ds[0])
ctx = cl.Context([dev])
mark("Context")
q = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
mark("CommandQueue")
mf = cl.mem_flags
for i in range(3):
    b = cl.Buffer(ctx, mf.READ_WRITE | mf.ALLOC_HOST_PTR, 128 << 20)
    mark(f"Buffer ALLOC_HOST_PTR 128 MiB #{i}")
    a, _ = cl.enqueue_map_buffer(q, b, cl.map_flags.READ | cl.map_flags.WRITE, 0, (32 << 20,), numpy.float32)
    mark(f"map #{i}")
    a[::1024] = 1
    mark(f"touch #{i}")
import h5py
mark("import h5py")
import nibabel
mark("import nibabel")
print(json.dumps(out))
"""
)

OVERLAP = (
    r"""
import ctypes, glob, importlib.util, json, os, threading, time
"""
    + DRIVER
    + r"""
t00 = time.perf_counter()
done = {}
import numpy, pyopencl as cl
done["numpy, pyopencl"] = time.perf_counter() - t00
def driver():
    if os.environ.get("PROBE_PYOPENCL"):
        ps = cl.get_platforms(); ds = [d for p in ps for d in p.get_devices()]
        done["platforms"] = time.perf_counter() - t00
        want = os.environ["PROBE_DEVICE"].lower()
        dev = next((d for d in ds if want in d.name.lower() or want in d.platform.name.lower()), ds[0])
        ctx = cl.Context([dev]); done["context"] = time.perf_counter() - t00
        bs = [cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR, 128 << 20) for _ in range(3)]
        done["buffers"] = time.perf_counter() - t00
        return
    lib = loader()
    devs = devices(lib, platforms(lib))
    done["platforms"] = time.perf_counter() - t00
    if os.environ.get("PROBE_CONTEXT"):
        ctx = context(lib, chosen(lib, devs))
        done["context"] = time.perf_counter() - t00
        for i in range(3):
            pinned(lib, ctx)
        done["buffers"] = time.perf_counter() - t00
th = threading.Thread(target=driver); th.start()
import h5py, nibabel, volconv.pipeline, volconv.console
done["imports"] = time.perf_counter() - t00
th.join()
done["joined"] = time.perf_counter() - t00
print(json.dumps(done))
"""
)

BUILDS = r"""
import json, sys, threading, time
import pyopencl as cl
from volconv import config, pipeline, programs
cfg = config.load(sys.argv[1], (), device=sys.argv[2])
device = pipeline.choose_device(cfg)
jobs = pipeline.plan_jobs(cfg, device, overwrite=True)
seen = []
real = programs.build.__wrapped__
def spy(ctx, name, defines, options=()):
    seen.append((name, defines, options))
    return real(ctx, name, defines, options)
programs.build = spy
import volconv.separable, volconv.engine, volconv.convert
for m in (volconv.separable, volconv.engine, volconv.convert):
    if hasattr(m, "build"):
        m.build = spy
t = time.perf_counter()
conv = pipeline.Convolvers(cfg, device)
conv.get(jobs[0])
out = {"convolvers.get (programs + 3 pinned)": time.perf_counter() - t, "programs": [s[0] for s in seen]}
ctx, _ = programs.context_for(device)
def flags(d, o): return [f"-D{k}={v}" for k, v in d] + list(o)
binaries = []
t = time.perf_counter()
for name, d, o in seen:
    p = cl.Program(ctx, programs.kernel_source(name)).build(options=flags(d, o))
    binaries.append(p.get_info(cl.program_info.BINARIES)[0])
out["source builds, serial"] = time.perf_counter() - t
t = time.perf_counter()
for (name, d, o), b in zip(seen, binaries):
    cl.Program(ctx, [device], [b]).build(options=flags(d, o))
out["binary builds, serial"] = time.perf_counter() - t
out["binary bytes"] = [len(b) for b in binaries]
def both(fn):
    ths = [threading.Thread(target=fn, args=(i,)) for i in range(len(seen))]
    t = time.perf_counter()
    [x.start() for x in ths]; [x.join() for x in ths]
    return time.perf_counter() - t
out["source builds, threads"] = both(lambda i: cl.Program(ctx, programs.kernel_source(seen[i][0])).build(options=flags(seen[i][1], seen[i][2])))
out["binary builds, threads"] = both(lambda i: cl.Program(ctx, [device], [binaries[i]]).build(options=flags(seen[i][1], seen[i][2])))
print(json.dumps(out))
"""


def fresh(code: str, env: dict | None = None, args: tuple = ()) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, check=False)  # fmt: skip
    if r.returncode:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def minima(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if all(isinstance(r.get(k), float) for r in runs)]
    out = {k: min(r[k] for r in runs) for k in keys}
    out.update({k: v for k, v in runs[0].items() if k not in out})
    return out


def unlink_cost(folder: Path, size: int = 512 << 20) -> dict:
    out: dict[str, list[float]] = {"replace over it": [], "replace, old kept by a link": [],
                                   "unlink the link": []}  # fmt: skip
    block = os.urandom(1 << 20)

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            for _ in range(size >> 20):
                f.write(block)

    old, new, keep = folder / "old.bin", folder / "new.bin", folder / "keep.bin"
    for _ in range(REPEATS):
        write(old), write(new)
        os.sync()
        t = time.perf_counter()
        os.replace(new, old)
        out["replace over it"].append(time.perf_counter() - t)
        write(new)
        os.sync()
        t = time.perf_counter()
        os.link(old, keep)
        os.replace(new, old)
        out["replace, old kept by a link"].append(time.perf_counter() - t)
        t = time.perf_counter()
        os.unlink(keep)
        out["unlink the link"].append(time.perf_counter() - t)
        os.unlink(old)
    return {k: min(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pipeline")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    env = {"PROBE_DEVICE": a.device}
    out: dict = {}
    out["serial"] = minima([fresh(SERIAL, env) for _ in range(REPEATS)])
    out["ctypes"] = minima([fresh(CTYPES, env) for _ in range(REPEATS)])
    out["overlap, platforms only"] = minima([fresh(OVERLAP, env) for _ in range(REPEATS)])
    out["overlap, context and 3 buffers"] = minima(
        [fresh(OVERLAP, {**env, "PROBE_CONTEXT": "1"}) for _ in range(REPEATS)]
    )
    out["overlap, pyopencl context and 3 buffers"] = minima(
        [fresh(OVERLAP, {**env, "PROBE_PYOPENCL": "1"}) for _ in range(REPEATS)]
    )
    out["builds"] = minima([fresh(BUILDS, env, (a.pipeline, a.device)) for _ in range(2)])
    numpy = "import time; t = time.perf_counter(); import numpy; print(time.perf_counter() - t)"
    for name, extra in (("numpy", {}), ("numpy, OPENBLAS_NUM_THREADS=1",
                                        {"OPENBLAS_NUM_THREADS": "1"})):  # fmt: skip
        runs = [subprocess.run([sys.executable, "-c", numpy], capture_output=True, text=True,
                               env={**os.environ, **extra}).stdout for _ in range(REPEATS)]  # fmt: skip
        out[name] = min(float(r) for r in runs)
    with tempfile.TemporaryDirectory(dir=Path(a.pipeline).resolve().parent.parent) as d:
        out["unlink"] = unlink_cost(Path(d))
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)


if __name__ == "__main__":
    main()
