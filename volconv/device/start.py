"""What a `volconv run` makes ahead, in background threads, from its start: the programs its
last run of the same pipeline on that device took, and that run's first page-locked slab
buffer.

A run records, per pipeline (its file and its text as ``--set`` left it) and device
(``programs/start-*.json`` in the cache folder, under its trust rule), the programs it took
(`volconv.device.programs.TAKEN`) and the shapes of the page-locked slab buffers it made
(`page_locked`); the next run of that pipeline starts loading them as soon as its context is
started (`start_programs`): the driver's clBuildProgram and the mapping that page-locks memory
release the GIL, so they are made while the modules import and the pipeline is read and
planned. `build` then finds each program made, or waits for the one being made; `page_locked`
takes the buffer made ahead.
A record that names another pipeline's programs costs background work only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from concurrent.futures import Future
from contextlib import suppress
from pathlib import Path

import numpy as np
import pyopencl as cl

from volconv.device.cache import cache_folder, device_key, is_private, read_cached, write_cached
from volconv.device.driver import background
from volconv.device.programs import (
    _CONTEXTS,
    _MADE,
    TAKEN,
    build,
    build_sm90a,
    context_for,
    forget_builds,
)

START_FORMAT = "volconv start 2"
MOST_STARTED = 64  # programs a record names at most
MOST_LOCKED = 4  # page-locked buffers made ahead at most
# (device pointer, shape, dtype) -> the buffers made ahead of that shape, in turn
_LOCKED: dict[tuple[int, tuple[int, ...], str], list[Future[np.ndarray]]] = {}
_LOCKED_TAKEN: dict[int, list[list[object]]] = {}  # device pointer -> [shape, dtype] each
_LOCK = threading.Lock()


def page_locked(device: cl.Device, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A ``shape`` array of ``dtype`` in page-locked host memory of ``device``'s context (a
    mapped ALLOC_HOST_PTR buffer: what the device downloads into at the bus's speed): one
    made ahead (`start_programs`) of that shape and type, else made now. A call drops those
    made ahead of another shape or type (another pipeline's): they are freed unused."""
    dtype = np.dtype(dtype)
    key = (device.int_ptr, tuple(int(n) for n in shape), dtype.str)
    taken = _LOCKED_TAKEN.setdefault(device.int_ptr, [])
    if len(taken) < MOST_LOCKED:  # as many as the run makes, for the next one's start
        taken.append([list(key[1]), dtype.str])
    with _LOCK:
        ahead = _LOCKED.get(key, [])
        made = ahead.pop(0) if ahead else None
        for other in [k for k in _LOCKED if k[0] == device.int_ptr and not (k == key and ahead)]:
            del _LOCKED[other]  # memory the run does not count
    if made is not None and made.exception() is None:
        return made.result()
    return _page_locked(device, key[1], dtype)


def forget() -> None:
    """Forget the programs and page-locked buffers taken or made ahead, as a new process."""
    forget_builds()
    with _LOCK:
        _LOCKED.clear()
    _LOCKED_TAKEN.clear()


def _page_locked(device: cl.Device, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    ctx, queue = context_for(device)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.ALLOC_HOST_PTR,
                    dtype.itemsize * math.prod(shape))  # fmt: skip
    flags = cl.map_flags.READ | cl.map_flags.WRITE
    array, _ = cl.enqueue_map_buffer(queue, buf, flags, 0, shape, dtype)
    return array


def _start_name(device: cl.Device, pipeline: Path, text: str) -> str:
    key = f"{device_key(device)}\0{pipeline.resolve()}\0{text}"
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"programs/start-{digest[:32]}.json"


def _started_entries(data: bytes) -> tuple[list[tuple[str, str, tuple, tuple]], list[tuple]]:
    """The programs and page-locked buffers a start record names, checked: a record with
    anything else in it names none."""
    try:
        doc = json.loads(data)
        assert doc["format"] == START_FORMAT
        found = []
        for kind, name, defines, options in doc["programs"][:MOST_STARTED]:
            assert kind in ("build", "build_sm90a") and isinstance(name, str)
            assert re.fullmatch(r"\w+\.cl", name)
            defines = tuple((str(k), v) for k, v in defines)
            assert all(isinstance(v, int | float | str) for _, v in defines)
            assert all(isinstance(o, str) for o in options)
            found.append((kind, name, defines, tuple(options)))
        locked = []
        for shape, dtype in doc["page_locked"][:MOST_LOCKED]:
            assert all(type(n) is int and n > 0 for n in shape) and len(shape) <= 4
            assert dtype in ("<f4", "<f2", "|u1")
            locked.append((tuple(shape), np.dtype(dtype)))
    except (ValueError, KeyError, TypeError, AssertionError):
        return [], []
    return found, locked


def start_programs(device: cl.Device, pipeline: Path, text: str = "") -> Future[None] | None:
    """Load, in a background thread, the programs the last run of ``pipeline`` (whose text, after
    ``--set``, was ``text``) on ``device`` took (`record_programs`), from the binary cache
    (or built, where it misses): `build` then finds them made, or waits for the one being
    made. The thread's future, or None where ``device`` has no context made or started
    (`start_context`)."""
    if _CONTEXTS.get(device.int_ptr) is None and device.int_ptr not in _MADE:
        return None

    def load() -> None:
        folder = cache_folder()
        data = read_cached(folder, _start_name(device, pipeline, text), "not used")
        entries, locked = _started_entries(data) if data is not None else ([], [])
        if not entries and not locked:
            return
        ctx, _ = context_for(device)
        for shape, dtype in locked:  # beside the programs, each in a thread of its own
            with _LOCK:
                if device.int_ptr not in _LOCKED_TAKEN:  # else the run has begun taking
                    made = background(lambda s=shape, d=dtype: _page_locked(device, s, d),
                                      "volconv-page-locked")  # fmt: skip
                    _LOCKED.setdefault((device.int_ptr, shape, dtype.str), []).append(made)
        for kind, name, defines, options in entries:
            with suppress(Exception):  # a source changed since: the run builds what it needs
                (build_sm90a if kind == "build_sm90a" else build)(ctx, name, defines, options)

    return background(load, "volconv-programs")


def record_programs(device: cl.Device, pipeline: Path, text: str = "") -> None:
    """Record the programs and page-locked buffers this process took on ``device`` for the
    next run of ``pipeline`` with ``text`` (`start_programs`), where they differ from the
    record: a run of the same file with another ``--set`` (another output type) takes other
    programs and buffers."""
    taken = TAKEN.get(device.int_ptr)
    if not taken:
        return
    folder = cache_folder()
    if is_private(folder):
        return
    name = _start_name(device, pipeline, text)
    try:
        locked = _LOCKED_TAKEN.get(device.int_ptr, [])[:MOST_LOCKED]
        doc = {"format": START_FORMAT, "programs": taken[:MOST_STARTED], "page_locked": locked}
        data = json.dumps(doc).encode()
    except (TypeError, ValueError):  # a define that is not a number or text: not recorded
        return
    old = read_cached(folder, name, "written again")
    if old is not None and old == data:
        return
    with suppress(OSError):  # a read-only cache folder: the next run loads them as it goes
        write_cached(folder, name, data)
