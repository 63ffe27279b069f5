"""What a device keeps between the inputs of a run: one convolver per (shape, type, bank) and
its page-locked slab buffers (`Convolvers`, `PinnedSlabs`), and the peaks a run's
fractions are taken against (`RunResult`, `peaks`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from queue import Empty, SimpleQueue

import numpy as np
import pyopencl as cl

from volconv.bank.features import features_json
from volconv.config import Config
from volconv.device.peak import fp32_peak, measured_bandwidth, measured_peak, tensor_peak
from volconv.device.start import page_locked
from volconv.engines.convert import device_encodes
from volconv.engines.separable import SeparableConvolver
from volconv.report import VolumeReport
from volconv.run.jobs import Job
from volconv.run.memory import PINNED_BUFFERS


@dataclass
class RunResult:
    device: cl.Device
    peak_gflops: float | None
    peak_how: str
    measured_peak_gflops: float | None
    measured_bandwidth_gbps: float | None = None
    unit_peak_gflops: float | None = None
    reports: list[VolumeReport] = field(default_factory=list)
    seconds: float = 0.0  # the run's own wall: the first input's start to the last's end

    @property
    def failed(self) -> list[VolumeReport]:
        return [r for r in self.reports if r.status == "failed"]


def peaks(device: cl.Device) -> tuple[float | None, str, float | None, float | None, float | None]:
    """The FP32 peak fractions are taken against, how it was found, the FMA probe's rate and
    copy bandwidth if cached (a run never probes: `volconv devices --probe` does), and the
    tensor units' peak (None: none or unknown)."""
    measured = measured_peak(device, probe=False)
    peak = fp32_peak(device, measured)
    bandwidth = measured_bandwidth(device, probe=False)
    return peak.gflops, peak.how, measured, bandwidth, tensor_peak(device).gflops


class Convolvers:
    """One convolver per (shape, dtype, bank), with its pinned slab buffers: reused for every
    frame and file a device runs."""

    def __init__(self, cfg: Config, device: cl.Device) -> None:
        self.cfg, self.device = cfg, device
        self._cache: dict[tuple[object, ...], tuple[SeparableConvolver, PinnedSlabs]] = {}
        self._stored: dict[tuple[object, ...], tuple[float, float] | None] = {}

    @staticmethod
    def key(job: Job) -> tuple[object, ...]:
        """Inputs of one key share a convolver and its pinned buffers, and may overlap (the
        same uint8 scale too: the device's encoder holds it)."""
        return (*Convolvers._shared(job), job.scale, job.offset)

    @staticmethod
    def _shared(job: Job) -> tuple[object, ...]:
        return (job.shape3, np.dtype(job.volume.dtype).str, job.kernels.shape,
                job.kernels.tobytes(), features_json(job.expanded.features))  # fmt: skip

    def get(self, job: Job) -> tuple[SeparableConvolver, PinnedSlabs]:
        # one convolver for inputs that differ in their uint8 scale alone (scale = "auto" on
        # float inputs): its encoder is set again, never while another input uses it
        # (different keys never overlap)
        key, stored = self._shared(job), (job.scale, job.offset)
        if key not in self._cache:
            conv = SeparableConvolver(  # the job's plan, made once in `plan_jobs`
                job.run_filters, job.shape3, job.volume.dtype, device=self.device,
                expanded=job.expanded, plan=job.plan,
            )  # fmt: skip
            if device_encodes(self.device, self.cfg.dtype):  # first: buffers of that type
                conv.store(self.cfg.dtype, *stored)
            # as conv.pinned_slab makes them, or the one made ahead (volconv.device.start)
            shape = (conv.plan.n_outputs, conv.plan.slab_depth, *conv.plan.shape[1:])
            make = partial(page_locked, self.device, shape, conv.stored)
            self._cache[key] = conv, PinnedSlabs(make, PINNED_BUFFERS)
            self._stored[key] = stored
        conv, buffers = self._cache[key]
        if self._stored[key] != stored:  # the type stays: the buffers do too
            if device_encodes(self.device, self.cfg.dtype):  # else the writer encodes
                conv.store(self.cfg.dtype, *stored)
            self._stored[key] = stored
        return conv, buffers


class PinnedSlabs:
    """At most ``most`` page-locked slab buffers (``make()`` makes one), made as a run needs
    them: the first in a background thread from the start, another only when none is free.

    Page-locking takes time in the driver's map, which releases the GIL: the first buffer is
    made while the input is read and goes to the device, the others while the writer writes
    the slabs before (the device is ahead of the disk), rather than all before the run
    starts. `get` takes one, `put` gives it back.
    """

    def __init__(self, make: Callable[[], np.ndarray], most: int) -> None:
        self._make, self._left = make, most - 1
        self._free: SimpleQueue[np.ndarray] = SimpleQueue()
        self._lock = threading.Lock()
        self._first: Future[None] | None = Future()
        threading.Thread(target=self._make_first, args=(self._first,), name="volconv-pinned",
                         daemon=True).start()  # fmt: skip

    def _make_first(self, done: Future[None]) -> None:
        try:
            self._free.put(self._make())
            done.set_result(None)
        except BaseException as e:  # raised by `get`
            done.set_exception(e)

    def get(self) -> np.ndarray:
        """A free buffer: one given back, a new one while fewer than ``most`` exist, or the
        next one given back."""
        with self._lock:
            first, self._first = self._first, None
        if first is not None:
            first.result()
        try:
            return self._free.get_nowait()
        except Empty:
            pass
        with self._lock:
            new = self._left > 0
            self._left -= new
        return self._make() if new else self._free.get()

    def put(self, buffer: np.ndarray) -> None:
        self._free.put(buffer)
