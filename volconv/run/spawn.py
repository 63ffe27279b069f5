"""A local batch's worker processes (`Worker`), and their start before the command has
imported anything (`start_early`): nothing here imports numpy, pyopencl or the rest of
volconv.

A worker's first seconds go to Python's start, its imports and its device's context. A
command whose arguments ask for several devices (``volconv run P --devices all``, or the
pipeline's ``[run] devices``) starts one worker per device after the first as it starts, on
a host with the cores for them, while its own modules import and it plans: volconv.run.pool
takes them for the batch when the model wants them (`adopt`) and closes the others, which
end on their own. Either way a worker warms up for the batch's first input only once told.
For ``all`` the devices are known only once the OpenCL driver has started (a third of a
second on a GPU node): the second device's worker starts at once as ``all#1`` (the second of
`device_specs`, which it finds itself, `resolve_device`), the others once the driver is up.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from contextlib import suppress
from functools import cache
from pathlib import Path

# The device a worker owns, as --device takes it; set per worker process.
DEVICE_ENV = "VOLCONV_DEVICE"
# A local worker's name (volconv-1, ...), set by volconv.run.pool.
NAME_ENV = "VOLCONV_WORKER_NAME"
# The host cores a worker process takes (volconv.run.model); fewer per device: no early start.
CORES_PER_PROCESS = 4

# A worker's first lines: the OpenCL driver, then its device's context, start in the
# background while the modules that filter import; then it serves the client.
BOOT = """
from volconv.device.driver import start_driver
start_driver()
from volconv.run.spawn import resolve_device
resolve_device()
try:
    import os
    from volconv.device.devices import select_device
    from volconv.device.programs import start_context
    start_context(select_device(os.environ["{device_env}"]))
except Exception:
    pass  # its warm-up or first task says why
from volconv.run.workers import serve
serve({inbox}, {outbox})
"""


class Worker:
    """One local worker process on the device ``spec``, named ``name``; started at once."""

    def __init__(self, name: str, spec: str) -> None:
        self.name, self.spec = name, spec
        self.ready_at: float | None = None  # Unix time its warm-up was done
        self.ready_seconds: float | None = None  # from its first start to ready
        self.device = ""  # its device in words, as its records say
        self.in_flight: dict[int, object] = {}  # key -> the input (volconv.run.jobs.Job)
        self.starts = 0
        self._start()

    def _start(self) -> None:
        import subprocess
        import tempfile
        from multiprocessing.connection import Connection

        self.starts += 1
        self.ready_at = None
        self.started_at = time.time()
        to_worker, from_client = os.pipe()
        to_client, from_worker = os.pipe()
        code = BOOT.format(device_env=DEVICE_ENV, inbox=to_worker, outbox=from_worker)
        env = {**os.environ, DEVICE_ENV: self.spec, NAME_ENV: self.name}
        # why it died, where it says so; kept as long as the worker
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115
        # its own session: Ctrl-C at the terminal is this process's to answer (it stops the
        # worker's tasks at a slab's end); a worker's output would be noise on the command's
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(to_worker, from_worker), env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.stderr,
            start_new_session=True,
        )  # fmt: skip
        os.close(to_worker)
        os.close(from_worker)
        self.outbox = Connection(from_client, readable=False)
        self.inbox = Connection(to_client, writable=False)
        self._lock = threading.Lock()

    def send(self, message: tuple) -> bool:
        with self._lock:
            try:
                self.outbox.send(message)
                return True
            except OSError:  # the worker is gone: its reader finds out
                return False

    def close(self) -> None:
        """Close the pipe to the worker: it ends once what it runs stops."""
        with self._lock, suppress(OSError):
            self.outbox.close()

    def restart(self) -> None:
        with suppress(OSError):
            self.inbox.close()
        self.close()
        self._start()

    def lost(self) -> str:
        """Why the worker's pipe ended: its exit status, waited for a moment."""
        import subprocess

        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(1.0)
        code = self.proc.returncode
        why = f"exit {code}" if code is not None else "its pipe closed"
        with suppress(OSError):
            self.stderr.seek(max(0, self.stderr.seek(0, os.SEEK_END) - 4096))
            said = self.stderr.read().decode(errors="replace").strip().splitlines()
            if said:
                why += f": {said[-1][:300]}"
        return why


# The early spec of the k-th device of ``devices = "all"``: ``all#k``.
EVERY = "all#"


def resolve_device() -> None:
    """In a worker: an early spec ``all#k`` becomes the k-th of `device_specs` (in its
    environment, as `Worker` gave it); a worker with no such device ends."""
    spec = os.environ.get(DEVICE_ENV, "")
    if spec.startswith(EVERY):
        specs = device_specs() or []
        k = int(spec[len(EVERY) :])
        if k >= len(specs):
            os._exit(0)  # the command finds no such device either: it never feeds this one
        os.environ[DEVICE_ENV] = specs[k]


# The workers `start_early` started, not yet adopted or closed; the thread starting them.
_EARLY: list[Worker] = []
_STARTING: list[threading.Thread] = []
_LOCK = threading.Lock()


# Fewer inputs than this start no worker early: one worker saves at most half of two inputs,
# less than its start at a typical input's seconds (volconv.run.model decides for the rest).
EARLY_INPUTS = 3


def early_specs(argv: list[str]) -> list[str] | None:
    """The device specs of a ``volconv run`` command line's local batch, as far as its
    arguments tell them before anything is imported: ``--devices`` (``all`` or specs
    separated by commas), else the pipeline file's ``[run] devices``; None where it is no
    such batch (another command, one device, ``--scheduler``, fewer than `EARLY_INPUTS`
    inputs by `input_count`) or it cannot be told."""
    import tomllib

    if not argv or argv[0] != "run" or len(argv) < 2 or argv[1].startswith("-"):
        return None
    devices: object = None
    for i, arg in enumerate(argv):
        if arg in ("--scheduler", "--help", "-h") or arg.startswith("--scheduler="):
            return None
        if arg == "--devices" and i + 1 < len(argv):
            devices = argv[i + 1]
        elif arg.startswith("--devices="):
            devices = arg.split("=", 1)[1]
    try:
        pipeline = tomllib.loads(Path(argv[1]).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    run = pipeline.get("run", {})
    if devices is None:
        if not isinstance(run, dict) or run.get("scheduler"):
            return None
        devices = run.get("devices")
    specs = None
    if isinstance(devices, str):
        word = devices.strip().lower()
        if word == "all":
            specs = [f"{EVERY}0", f"{EVERY}1"]  # at least two; `start_early` starts the rest
        devices = None if word in ("one", "all") else devices.split(",")
    if isinstance(devices, list) and all(isinstance(s, str) and s.strip() for s in devices):
        specs = [s.strip() for s in devices]
    if specs and (count := input_count(argv, pipeline)) is not None and count < EARLY_INPUTS:
        return None
    return specs


def input_count(argv: list[str], pipeline: dict) -> int | None:
    """How many input files the command names, as far as it can be told without volconv's
    own reading of them: ``--set input.paths=...`` (relative to the working folder), else
    the pipeline's ``[input] paths`` (relative to its folder), each a file or a glob; None
    where it cannot be told."""
    import glob
    import tomllib

    paths, base = None, Path(argv[1]).parent
    for i, arg in enumerate(argv[:-1]):
        if arg == "--set" and argv[i + 1].startswith("input.paths="):
            value = argv[i + 1].split("=", 1)[1]
            try:
                paths = tomllib.loads(f"v = {value}")["v"]
            except ValueError:
                paths = value  # a bare path, as --set takes it
            base = Path.cwd()
    section = pipeline.get("input")
    if paths is None and isinstance(section, dict):
        paths = section.get("paths")
    paths = [paths] if isinstance(paths, str) else paths
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        return None
    count = 0
    for pattern in paths:
        full = str(base / os.path.expanduser(pattern))
        if os.path.isfile(full):
            count += 1
            continue
        name = full.rsplit(":", 1)[0] if ":" in os.path.basename(full) else full  # file:dataset
        files = [name] if os.path.isfile(name) else glob.glob(name, recursive=True)
        count += sum(map(os.path.isfile, files))
    return count


@cache
def device_specs() -> list[str] | None:
    """The ``platform:device`` spec of every GPU and accelerator of this machine (of every
    device where it has none), in pyopencl's order, as ``devices = "all"`` takes them
    (volconv.device.devices.every_device), through the ICD loader alone; None where it cannot
    be told."""
    from volconv.device.driver import driver_started, loader

    lib = loader()
    if lib is None:
        return None
    driver_started()
    count = ctypes.c_uint32()
    if lib.clGetPlatformIDs(0, None, ctypes.byref(count)) != 0 or not count.value:
        return None
    platforms = (ctypes.c_void_p * count.value)()
    if lib.clGetPlatformIDs(count.value, platforms, None) != 0:
        return None
    every, accelerators = [], []
    for pi, platform in enumerate(platforms):
        n = ctypes.c_uint32()
        if lib.clGetDeviceIDs(ctypes.c_void_p(platform), ctypes.c_uint64(0xFFFFFFFF), 0, None,
                              ctypes.byref(n)) != 0 or not n.value:  # fmt: skip
            continue  # a platform with no devices
        devices = (ctypes.c_void_p * n.value)()
        if lib.clGetDeviceIDs(ctypes.c_void_p(platform), ctypes.c_uint64(0xFFFFFFFF), n.value,
                              devices, None) != 0:  # fmt: skip
            return None
        for di, device in enumerate(devices):
            kind = ctypes.c_uint64()
            if lib.clGetDeviceInfo(ctypes.c_void_p(device), 0x1000, 8, ctypes.byref(kind),
                                   None) != 0:  # fmt: skip
                return None  # CL_DEVICE_TYPE
            every.append(f"{pi}:{di}")
            if kind.value & (4 | 8):  # CL_DEVICE_TYPE_GPU, CL_DEVICE_TYPE_ACCELERATOR
                accelerators.append(f"{pi}:{di}")
    return accelerators or every or None


def start_early(argv: list[str]) -> None:
    """Where ``argv`` is a local batch on several devices (`early_specs`) and this host has
    `CORES_PER_PROCESS` cores for each: start a worker for each device after the first, in
    a background thread, now."""

    def start() -> None:
        specs = early_specs(argv)
        if not specs or len(specs) < 2 or not cores_for(len(specs)):
            return
        spawn_early(specs[1:])
        if specs[0].startswith(EVERY) and (found := device_specs()) and cores_for(len(found)):
            spawn_early([f"{EVERY}{k}" for k in range(2, len(found))])

    thread = threading.Thread(target=start, name="volconv-early-workers", daemon=True)
    _STARTING.append(thread)
    thread.start()


def cores_for(processes: int) -> bool:
    """Whether this host has `CORES_PER_PROCESS` cores for each of ``processes``."""
    return (os.cpu_count() or 1) >= CORES_PER_PROCESS * processes


def spawn_early(specs: list[str]) -> None:
    """A worker for each of ``specs`` (named ``volconv-1``, ... in order), now."""
    with _LOCK:
        for spec in specs:
            _EARLY.append(Worker(f"volconv-{len(_EARLY) + 1}", spec))


def early_workers() -> list[Worker]:
    """The workers started early and not yet adopted or closed (once their start is done),
    each ``all#k`` spec resolved as the worker resolves it (one with no such device closed)."""
    for thread in _STARTING:
        thread.join()
    with _LOCK:
        for w in list(_EARLY):
            if w.spec.startswith(EVERY):
                specs, k = device_specs() or [], int(w.spec[len(EVERY) :])
                if k < len(specs):
                    w.spec = specs[k]
                else:
                    w.close()
                    _EARLY.remove(w)
        return list(_EARLY)


def adopt(spec: str) -> Worker | None:
    """The first early worker on ``spec``, now the caller's; None where there is none."""
    with _LOCK:
        for w in _EARLY:
            if w.spec == spec:
                _EARLY.remove(w)
                return w
    return None


def close_early() -> None:
    """Close every early worker nobody adopted: each ends on its own."""
    for thread in _STARTING:
        thread.join(1.0)  # one still starting: closed with the others
    with _LOCK:
        for w in _EARLY:
            w.close()
        _EARLY.clear()
