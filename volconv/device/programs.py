"""OpenCL programs: the kernel sources of kernels/, the one build path, and the one context
per device and process. The engine, the FMA probe and every other kernel user build here.

Nothing touches OpenCL at import time, so importing volconv before a fork is safe; contexts
are made on first use, in the process that uses them, or started ahead (`start_context`,
after `volconv.device.driver.start_driver`) by a `volconv run` that knows it will need them,
which also loads the programs its last run of the same pipeline on that device took
(`volconv.device.start`). volconv's cache folder (program binaries for every kind of device, the
FMA probe, the tuning) is `volconv.device.cache`'s.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import re
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from numbers import Integral
from pathlib import Path

import pyopencl as cl

from volconv.device.cache import (
    cache_folder,
    device_key,
    is_private,
    read_cached,
    say_once,
    write_cached,
)
from volconv.device.driver import background, shared_loader


def kernel_folder() -> Traversable:
    """kernels/: installed as the data package volconv.kernels, or the checkout's when volconv
    is imported from a source tree."""
    try:
        return resources.files("volconv.kernels")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "kernels"


@cache
def kernel_source(name: str) -> str:
    """The text of kernels/``name`` (`kernel_folder`)."""
    return kernel_folder().joinpath(name).read_text()


# -- the context, started ahead -------------------------------------------------------------
# clCreateContext through ctypes releases the GIL (volconv.device.driver), so that a
# `volconv run` imports its modules and reads its pipeline meanwhile.
_CONTEXTS: dict[int, Future[int | None]] = {}  # device pointer -> context pointer, or None
_MADE: set[int] = set()  # devices `context_for` has made or taken a context for


def start_context(device: cl.Device) -> None:
    """Start making ``device``'s context (`context_for` takes it) in a background thread."""
    if device.int_ptr in _CONTEXTS or device.int_ptr in _MADE or (lib := shared_loader()) is None:
        return
    pointer = ctypes.c_void_p(device.int_ptr)

    def make() -> int | None:
        status = ctypes.c_int32()
        made = lib.clCreateContext(None, 1, ctypes.byref(pointer), None, None,
                                   ctypes.byref(status))  # fmt: skip
        return made if status.value == 0 and made else None

    _CONTEXTS[device.int_ptr] = background(make, "volconv-context")


_CONTEXT_LOCK = threading.Lock()  # one context per device, whichever thread asks first


def context_for(device: cl.Device) -> tuple[cl.Context, cl.CommandQueue]:
    """The process's one context and profiling queue for ``device``, made on first use (or
    taken from `start_context`)."""
    with _CONTEXT_LOCK:
        return _context_for(device)


@cache
def _context_for(device: cl.Device) -> tuple[cl.Context, cl.CommandQueue]:
    _MADE.add(device.int_ptr)
    started = _CONTEXTS.pop(device.int_ptr, None)
    made = started.result() if started is not None and started.exception() is None else None
    # the started one is this process's to own; a failed start is made again, by pyopencl,
    # which reports the driver's error
    ctx = cl.Context.from_int_ptr(made, retain=False) if made else cl.Context([device])
    queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    return ctx, queue


def build(
    ctx: cl.Context,
    name: str,
    defines: tuple[tuple[str, object], ...],
    options: tuple[str, ...] = (),
) -> cl.Program:
    """Build kernels/``name`` with ``-D`` defines and other compiler ``options``, once per
    process, from the binary cache when it holds it (`binary_build`)."""
    key = ("build", ctx, name, defines, options)
    return _once(key, lambda: _build(ctx, name, defines, options))


def _build(
    ctx: cl.Context, name: str, defines: tuple[tuple[str, object], ...], options: tuple[str, ...]
) -> cl.Program:
    flags = [f"-D{k}={v}" for k, v in defines] + list(options)
    source = kernel_source(name)

    def make() -> tuple[cl.Program, list[str]]:
        return cl.Program(ctx, source).build(options=flags), flags

    return binary_build(ctx, source, flags, make)


SM90A_LINE = "//@ "  # kernels/tensor_int8.cl's wgmma lines under WGMMA_COMMENT


def build_sm90a(
    ctx: cl.Context,
    name: str,
    defines: tuple[tuple[str, object], ...],
    options: tuple[str, ...] = (),
) -> cl.Program:
    """Build kernels/``name`` with wgmma for sm_90a, which NVIDIA's OpenCL does not target (its
    PTX says sm_90, whose ptxas refuses wgmma): with ``-cl-nv-arch sm_90a`` where the driver
    takes it and the split is not persistent; else the kernel compiled with its wgmma lines
    as PTX comments (WGMMA_COMMENT), and the PTX made sm_90a's (`sm90a_ptx`, with the
    persistent split's groups per multiprocessor) built as the binary. Cached as `build`."""
    key = ("build_sm90a", ctx, name, defines, options)
    return _once(key, lambda: _build_sm90a(ctx, name, defines, options))


def _build_sm90a(
    ctx: cl.Context, name: str, defines: tuple[tuple[str, object], ...], options: tuple[str, ...]
) -> cl.Program:
    flags = [f"-D{k}={v}" for k, v in defines]
    source = kernel_source(name)
    found = dict(defines)
    groups, threads = int(found.get("PERSISTENT", 0)), 32 * int(found["WY"]) * int(found["WZ"])

    def make() -> tuple[cl.Program, list[str]]:
        if not groups:  # else the PTX route, where .minnctapersm can say it
            arch = [*flags, "-cl-nv-arch", "sm_90a", *options]
            try:
                return cl.Program(ctx, source).build(options=arch), arch
            except cl.Error:
                pass
        ptx = cl.Program(ctx, source).build(options=[*flags, "-DWGMMA_COMMENT=1"])
        text = ptx.get_info(cl.program_info.BINARIES)[0].rstrip(b"\0").decode()
        text = sm90a_ptx(text, groups, threads)
        program = cl.Program(ctx, ctx.devices[:1], [text.encode()]).build(options=list(options))
        return program, list(options)

    return binary_build(ctx, source, [*flags, *options, "sm_90a"], make)


# -- once a process -------------------------------------------------------------------------
# Every program is built once a process (`build`, `build_sm90a`): a thread that asks for one
# another thread is building waits for it (the programs a run loads ahead,
# `volconv.device.start`, and the run itself). What the process took is kept per device, in
# the form `volconv.device.start` records for the next run.
_BUILDS: dict[tuple[object, ...], Future[cl.Program | None]] = {}
_BUILDS_LOCK = threading.Lock()
TAKEN: dict[int, list[list[object]]] = {}  # device pointer -> [kind, name, defines, options]


def _once(key: tuple[object, ...], make: Callable[[], cl.Program]) -> cl.Program:
    """``make()`` once a process for ``key`` (kind, context, name, defines, options), or what
    another thread made or is making for it; a build that failed is not kept (the next
    caller builds again and sees its own error)."""
    kind, ctx, *rest = key
    key = (kind, ctx.int_ptr, *rest)
    taken = TAKEN.setdefault(ctx.devices[0].int_ptr, [])
    # recorded where JSON gives the same key and flags back (numpy's integers as int)
    defines = [[k, int(v) if isinstance(v, Integral) else v] for k, v in rest[1]]
    entry = [kind, rest[0], defines, list(rest[2])]
    if entry not in taken and all(type(v) in (int, float, str) for _, v in defines):
        taken.append(entry)
    while True:
        with _BUILDS_LOCK:
            future = _BUILDS.get(key)
            mine = future is None
            if mine:
                future = _BUILDS[key] = Future()
        if not mine:
            program = future.result()
            if program is not None:
                return program
            continue  # the other thread's build failed: this one builds (and raises) itself
        try:
            program = make()
        except BaseException:
            with _BUILDS_LOCK:
                del _BUILDS[key]
            future.set_result(None)
            raise
        future.set_result(program)
        return program


def forget_builds() -> None:
    """Forget the programs built (as a new process would): the next `build` loads or builds
    them again."""
    with _BUILDS_LOCK:
        _BUILDS.clear()
    TAKEN.clear()


def sm90a_ptx(text: str, min_groups: int = 0, threads: int = 0) -> str:
    """The PTX of a kernel compiled with WGMMA_COMMENT made sm_90a's: its wgmma lines
    uncommented, its target sm_90a, its ISA at least 8.0; with ``min_groups``, each entry's
    ``.minnctapersm`` (beside a ``.maxntid`` of ``threads`` where it has no bound of its own)
    asks ptxas for as few registers as let that many work-groups of ``threads`` share a
    multiprocessor (the persistent split's groups: the driver takes no register cap)."""
    text = re.sub(
        r"^\.target\s+sm_90\b", ".target sm_90a", text.replace(SM90A_LINE, ""), flags=re.M
    )
    version = re.search(r"^\.version\s+(\d+)\.(\d+)", text, flags=re.M)
    if version and (int(version[1]), int(version[2])) < (8, 0):  # wgmma: PTX ISA 8.0
        text = text.replace(version[0], ".version 8.0", 1)
    if min_groups:  # between an entry's parameters (and bounds) and its body

        def bound(m: re.Match) -> str:
            head = m[1]
            if threads and not re.search(r"\.(maxntid|reqntid)\b", head):
                head += f"\n.maxntid {threads}, 1, 1"
            return f"{head}\n.minnctapersm {min_groups}{m[2]}{{"

        text = re.sub(r"(\.entry\s[^{]*?)(\s*)\{", bound, text, flags=re.S)
    return text


# -- the binary cache ----------------------------------------------------------------------
# programs/<key>.bin in the cache folder (volconv.device.cache, which applies the trust rule): a
# header line naming the format, then a JSON line with the digest of what the binary was
# built from (format, device key, source, options), the payload's SHA-256 and the options
# it is built with, then the driver's binary (a CPU's object code, NVIDIA's PTX).
PROGRAM_MAGIC = b"volconv program 1\n"
VERBOSE = ("-cl-nv-verbose",)  # builds whose compiler report is wanted: never cached
_BUILT: list[str] = []  # the device whose build was announced (once a process)


def program_digest(device: cl.Device, source: str, options: list[str] | tuple[str, ...]) -> str:
    """The SHA-256 (hex) of what a program binary is built from: the format, the device key
    (platform, device, driver), the source and the options."""
    parts = (PROGRAM_MAGIC.decode().strip(), device_key(device), source, *options)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def pack_program(digest: str, binary: bytes, options: list[str]) -> bytes:
    """A cache entry: `PROGRAM_MAGIC`, the header line, the binary."""
    header = {"digest": digest, "sha256": hashlib.sha256(binary).hexdigest(), "options": options}
    return PROGRAM_MAGIC + json.dumps(header).encode() + b"\n" + binary


def unpack_program(data: bytes, digest: str) -> tuple[bytes, list[str]] | str:
    """The binary and its build options, or why the entry is refused."""
    if not data.startswith(PROGRAM_MAGIC):
        return "not a volconv program binary"
    head, _, binary = data[len(PROGRAM_MAGIC) :].partition(b"\n")
    try:
        header = json.loads(head)
        options = [str(o) for o in header["options"]]
        stale = header["digest"] != digest
        damaged = header["sha256"] != hashlib.sha256(binary).hexdigest()
    except (ValueError, KeyError, TypeError):
        return "a damaged header"
    if stale:
        return "built from another source, options or device (stale)"
    if damaged:
        return "a damaged binary (its SHA-256 differs)"
    return binary, options


def binary_build(
    ctx: cl.Context,
    source: str,
    options: list[str],
    make: Callable[[], tuple[cl.Program, list[str]]] | None = None,
    cache_dir: Path | None = None,
) -> cl.Program:
    """The program of ``source`` and ``options`` for ``ctx``'s first device: loaded from the
    binary cached under the cache folder's programs/ (`volconv.device.cache.cache_folder`; entries
    keyed and checked by `program_digest`), on every kind of device; else built by ``make``
    (default: from source with ``options``), which returns the program and the options its
    binary is built with, and its binary cached.

    A cache hit skips the compiler's front end (on NVIDIA the whole OpenCL C compile). An
    entry that fails the trust rule is ignored with a warning; one that is stale or damaged,
    or that the driver refuses, is built again and replaced. pyopencl's CompilerWarning about
    a non-empty build log is kept from the user.
    """
    device = ctx.devices[0]
    if make is None:

        def make() -> tuple[cl.Program, list[str]]:
            return cl.Program(ctx, source).build(options=options), options

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cl.CompilerWarning)
        if any(o in VERBOSE for o in options):
            return make()[0]
        folder = cache_folder(cache_dir)
        digest = program_digest(device, source, options)
        name = f"programs/{digest[:32]}.bin"
        data = read_cached(folder, name, "built again")
        if data is not None:
            found = unpack_program(data, digest)
            if isinstance(found, str):
                if found != "not a volconv program binary":  # an older volconv's: replaced
                    say_once(str(folder / name), f"{folder / name}: {found}; refused, built "
                                                 "again", stacklevel=3)  # fmt: skip
            else:
                binary, load = found
                with suppress(cl.Error):  # refused (another driver): built again
                    return cl.Program(ctx, [device], [binary]).build(options=load)
        _announce(device, folder)
        program, load = make()
        binary = program.get_info(cl.program_info.BINARIES)[0]
        with suppress(OSError):  # a read-only cache folder: the next process builds again
            write_cached(folder, name, pack_program(digest, binary, load))
        return program


def _announce(device: cl.Device, folder: Path) -> None:
    """Say once a process that kernels are compiled, and where later runs find them (once
    whichever threads compile: the run's and the one loading programs ahead)."""
    with _BUILDS_LOCK:
        if _BUILT:
            return
        _BUILT.append(device_key(device))
    name = f"{device.name.strip()} ({device.platform.name.strip()})"
    if is_private(folder):
        later = "the cache folder is not trusted, so later runs build them again"
    else:
        later = f"later runs load them from {folder / 'programs'}"
    print(f"volconv: building kernels for {name}, once; {later}", file=sys.stderr, flush=True)


def device_seconds(events: list[cl.Event]) -> float:
    """Seconds ``events`` ran on the device, summed (OpenCL profiling counters)."""
    return sum(e.profile.end - e.profile.start for e in events) * 1e-9
