"""The run: planned jobs -> one output file per input, on one device.

`run_one` runs one job end to end (read -> kernel -> write -> record) and returns its record;
`run_overlapped` runs jobs in order, input i+1 read and on the device while input i is
written; `run` is their simplest caller: plan, then every input on one device. A reader
thread fetches the next slab's rows while the device works on this one, and the writer's
thread writes the previous one. Planning is `volconv.run.jobs`'s, Ctrl-C
`volconv.run.interrupts`'.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache, partial
from pathlib import Path

import numpy as np

import volconv
from volconv.bank.features import features_json
from volconv.checks import as_float32
from volconv.config import Config
from volconv.device.devices import device_name
from volconv.engines.direct import STAGES
from volconv.engines.separable import SeparableConvolver
from volconv.errors import OutputWriteError, resource_cause
from volconv.output import OutputExistsError, Space, is_complete, open_writer
from volconv.report import VolumeReport, throughput
from volconv.run.convolvers import Convolvers, PinnedSlabs, RunResult, peaks
from volconv.run.interrupts import OPEN_WRITERS, STOP, Interrupted, interruptible, stop_on_ctrl_c
from volconv.run.jobs import USER_ERRORS, Job, choose_device, differences, plan_jobs
from volconv.run.resume import Progress, fingerprint
from volconv.run.volume import InputError


def run(
    cfg: Config,
    *,
    overwrite: bool = False,
    report: str | Path | None = None,
    on_plan: Callable[[list[Job]], None] | None = None,
    on_slab: Callable[[Job], None] | None = None,
    on_volume: Callable[[VolumeReport], None] | None = None,
) -> RunResult:
    """Filter every input of ``cfg`` into its output file, on one device, in order, inputs
    overlapping (`run_overlapped`).

    ``on_plan`` sees the jobs before any compute (for a progress total), ``on_slab`` is called
    after each slab and ``on_volume`` with each input's report, skipped ones included, in
    order. ``report``, the file the caller writes the run's report to, is checked with the
    outputs.
    """
    device = choose_device(cfg)
    jobs = plan_jobs(cfg, device, overwrite=overwrite, report=report)
    result = RunResult(device, *peaks(device))
    if on_plan:
        on_plan(jobs)
    convolvers = Convolvers(cfg, device)
    start = time.perf_counter()
    with stop_on_ctrl_c(result.reports, resumable=not overwrite):
        interruptible(run_overlapped, cfg, jobs, convolvers, result, overwrite=overwrite,
                      on_slab=on_slab, on_volume=on_volume)  # fmt: skip
    result.seconds = time.perf_counter() - start
    return result


class _Aborted(RuntimeError):
    """Another input of the run failed: this one stops at its next slab."""


# What stops a one-device run rather than failing one input: the user's mistakes found while
# running (exit 2), a full disk (the inputs after would fail the same way) and Ctrl-C. An input
# found corrupt mid-read or a device error fails that input alone, as in a batch (exit 1).
STOPS_THE_RUN = (*USER_ERRORS, OutputWriteError, _Aborted)


def run_overlapped(
    cfg: Config,
    jobs: Iterable[Job],
    convolvers: Convolvers,
    result: RunResult,
    *,
    overwrite: bool = False,
    on_slab: Callable[[Job], None] | None = None,
    on_volume: Callable[[VolumeReport], None] | None = None,
) -> None:
    """Run ``jobs`` in order, overlapping: input i+1's first frame is read while input i is
    on the device (where it is read whole and does not map), and input i+1 goes to the
    device as soon as input i has handed its last slab to its writer, while that writer
    still writes. Records go into ``result.reports`` in order. ``jobs`` may be an iterator
    (a batch's queue shared with other devices): input i+1 is taken from it when input i's
    first slab is done (to read it ahead), else when input i leaves the device.

    Memory stays within ``host_memory``: inputs that overlap share one convolver and its
    pinned buffers (the same shape, type and bank), which input i's writer gives back as it
    writes them; an input with another convolver waits until the one before is complete; a
    frame is read ahead only where it fits beside what input i holds (`Job.host_bytes`).
    An input that fails for its own reason becomes a failed record and the others go on;
    what `STOPS_THE_RUN` stops the other input at its next slab (its file removed) and raises.
    """
    abort = threading.Event()
    ahead: dict[int, Future[np.ndarray]] = {}  # index of a job -> its first frame

    def slab_done(job: Job) -> None:
        if abort.is_set():
            raise _Aborted("another input of the run failed")
        i = index[id(job)]
        if i + 1 not in ahead and has(i + 1) and reads_ahead(job, taken[i + 1]):
            ahead[i + 1] = reader.submit(read_frame, taken[i + 1], 0)  # job's frame is up
        if on_slab:
            on_slab(job)

    def reads_ahead(job: Job, following: Job) -> bool:
        frame = math.prod(following.shape3) * np.dtype(following.volume.dtype).itemsize
        return (following.whole_frames and not following.volume.mapped
                and (overwrite or not following.complete)
                and job.host_bytes + frame <= cfg.host_memory)  # fmt: skip

    def one(job: Job, left: threading.Event) -> VolumeReport:
        try:
            return run_one(
                cfg,
                job,
                convolvers,
                result,
                overwrite=overwrite,
                on_slab=slab_done,
                on_device_done=left.set,
                first_frame=ahead.get(index[id(job)]),
            )
        except Exception as e:
            if resource_cause(e) is not None:  # out of descriptors, memory or disk: the
                raise  # machine's trouble, which stops the run
            if isinstance(e, InputError):  # planned, then unreadable (corrupt, changed)
                return job.failed(str(e))  # this input's own trouble: the others go on
            if isinstance(e, STOPS_THE_RUN):
                raise
            return job.failed(f"{type(e).__name__}: {e}")  # as an InputError (exit status 1)
        finally:
            left.set()
            ahead.pop(index[id(job)], None)  # the frame goes with its input

    def collect(future: Future[VolumeReport]) -> None:
        try:
            record = future.result()
        except BaseException:
            abort.set()
            raise
        result.reports.append(record)
        if on_volume:
            on_volume(record)

    source, taking = iter(jobs), threading.Lock()
    taken: list[Job] = []  # the inputs taken from ``jobs`` so far, in order
    index: dict[int, int] = {}  # id of a job -> its place in ``taken``

    def has(i: int) -> bool:
        """Whether input i exists, taking it from ``jobs`` where not yet taken."""
        with taking:
            while len(taken) <= i and (job := next(source, None)) is not None:
                index[id(job)] = len(taken)
                taken.append(job)
            return i < len(taken)

    previous: tuple[Future[VolumeReport], Job] | None = None
    with (
        ThreadPoolExecutor(2, thread_name_prefix="volconv-input") as pool,
        ThreadPoolExecutor(1, thread_name_prefix="volconv-read-ahead") as reader,
    ):
        i = 0
        while has(i):
            job, i = taken[i], i + 1
            # done already (a failure raises before the next input starts), or with another
            # convolver: two convolvers' buffers at once could pass host_memory
            if previous and (previous[0].done() or Convolvers.key(previous[1]) !=
                             Convolvers.key(job)):  # fmt: skip
                collect(previous[0])
                previous = None
            left = threading.Event()
            future = pool.submit(one, job, left)
            while not left.wait(0.05):  # until this input is off the device
                if previous and previous[0].done() and previous[0].exception():
                    abort.set()  # the one before failed: this one stops at its next slab
                    break
            if previous:
                collect(previous[0])
            previous = future, job
        if previous:
            collect(previous[0])


def run_one(
    cfg: Config,
    job: Job,
    convolvers: Convolvers,
    peaks: RunResult,
    *,
    overwrite: bool = False,
    on_slab: Callable[[Job], None] | None = None,
    on_device_done: Callable[[], None] | None = None,
    first_frame: Future[np.ndarray] | None = None,
) -> VolumeReport:
    """Run one input end to end on the convolvers' device and return its record.

    An output that became complete since planning (another run of the same pipeline finished
    it first) is skipped, not an error; a run that finishes second replaces it atomically
    with the same result. ``on_device_done`` is called once the last slab is handed to the
    writer (the device and the convolver are free for the next input; the writing goes on);
    ``first_frame``, the input's first frame read ahead (`read_frame`), if it was.
    """
    if job.complete and not overwrite:
        return job.skipped()
    if not overwrite and is_complete(job.output) and not differences(job, cfg):
        return job.skipped("became complete meanwhile (another run)")
    try:
        return _stream(cfg, job, *convolvers.get(job), peaks, overwrite, on_slab, on_device_done,
                       first_frame)  # fmt: skip
    except OutputExistsError:
        if is_complete(job.output) and not differences(job, cfg):
            return job.skipped("became complete meanwhile (another run)")
        raise


def narrowed(data: np.ndarray, spec: str) -> np.ndarray:
    """float64 as the engine would convert it, converted here, once, and checked."""
    if data.dtype.kind != "f" or data.dtype.itemsize <= 4:
        return data
    try:
        return as_float32(data, "it")
    except ValueError as e:
        raise InputError(f"{spec}: {e}") from None


def read_frame(job: Job, t: int) -> np.ndarray:
    """Frame ``t`` of ``job``'s input, whole, as the convolver takes it."""
    return narrowed(job.volume.read_frame(t), job.spec)


def _stream(
    cfg: Config,
    job: Job,
    conv: SeparableConvolver,
    buffers: PinnedSlabs,
    peaks: RunResult,
    overwrite: bool,
    on_slab: Callable[[Job], None] | None,
    on_device_done: Callable[[], None] | None = None,
    first_frame: Future[np.ndarray] | None = None,
) -> VolumeReport:
    # The wall time: from here (reading starts, or the wait for the first frame read ahead
    # while the input before was on the device) to the last slab written (`drain`). Inputs
    # overlap (`run_overlapped`), so walls of neighbours overlap; the run's is RunResult.seconds.
    # stages["read"] is the time this input waited for its reads.
    t_start, started_at = time.perf_counter(), time.time()
    volume = job.volume
    before = dict(conv.timings)
    four_d = len(volume.shape) == 4
    work = [(t, a, b) for t in range(volume.n_frames) for a, b in conv.slabs()]
    read_seconds = 0.0
    frames: dict[int, np.ndarray] = {}  # the frame read whole, if it is

    def read(t: int, a: int, b: int) -> dict[str, np.ndarray]:
        """What the convolver takes for slab [a, b) of frame t: the whole frame (read once;
        reads run one at a time, in order, so one frame is held) or the slab's rows."""
        nonlocal read_seconds
        t0 = time.perf_counter()
        if job.whole_frames:
            if t not in frames:
                frames.clear()
                ahead = first_frame if t == 0 else None
                frames[t] = ahead.result() if ahead else read_frame(job, t)
            given = {"frame": frames[t]}
        else:
            given = {"rows": narrowed(volume.read_rows(conv.source_rows(a, b), t), job.spec)}
        read_seconds += time.perf_counter() - t0
        return given

    # volconv.run.resume: a dead run's partial output continues (never with --overwrite)
    digest = cache(volume.sha256)
    progress = None if overwrite else Progress(fingerprint(job, cfg, conv), digest)
    writer = open_writer(
        job.output, tuple(volume.shape), job.outputs, format=cfg.format, dtype=cfg.dtype,
        compression=cfg.compression, scale=job.scale, offset=job.offset, boundary=cfg.boundary,
        cval=cfg.cval, slab_depth=conv.plan.slab_depth, overwrite=overwrite, progress=progress,
        space=Space.of(volume),
    )  # fmt: skip
    OPEN_WRITERS.add(writer)
    with writer, ThreadPoolExecutor(2, thread_name_prefix="volconv-read") as pool:
        kept, work = resumed(progress, work, job, on_slab)
        sha: Future[str] = pool.submit(digest)  # the whole file once, beside the work
        if progress:
            sha.add_done_callback(progress.input_known)
        pending = pool.submit(read, *work[0]) if work else None  # None: every slab was kept
        try:
            for i, (t, a, b) in enumerate(work):
                if STOP.is_set():
                    raise Interrupted
                given = pending.result()
                if i + 1 < len(work):  # prefetch the next slab while the device works
                    pending = pool.submit(read, *work[i + 1])
                buffer = buffers.get()  # free once the writer has written it
                counted = conv.counts
                responses = conv.convolve_slab(a, b, out=buffer[:, : b - a], **given)
                del given
                counts = tuple(n - m for n, m in zip(conv.counts, counted, strict=True))
                writer.write_slab(a, b, responses, frame=t if four_d else None,
                                  release=partial(buffers.put, buffer), counts=counts)  # fmt: skip
                if on_slab:
                    on_slab(job)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: what is on disk stays, to resume
            writer.keep()
            raise
        finally:
            if pending is not None:
                pending.cancel()
        frames.clear()
        # the convolver's figures now: the next input may use it while this one is written
        stages = {k: conv.timings[k] - before[k] for k in STAGES}
        if on_device_done:
            on_device_done()
        writer.drain()  # every slab on disk: the wall time below covers the writing too
        source_sha256 = sha.result()
        wall = time.perf_counter() - t_start  # the file and the report say the same
        # the share of the input this run computed: 1 unless it resumed a partial output
        share = sum(b - a for _, a, b in work) / job.shape3[0] / volume.n_frames
        record = throughput(
            gflop=job.gflop * share, kernel_seconds=stages["kernel"], wall_seconds=wall,
            peak_gflops=peaks.peak_gflops, measured_peak_gflops=peaks.measured_peak_gflops,
            executed_gflop=conv.executed_gflop * volume.n_frames * share,
            engine=",".join(conv.engines), kernel_bytes=conv.kernel_bytes * volume.n_frames * share,
            measured_bandwidth_gbps=peaks.measured_bandwidth_gbps,
            unit_gflop=conv.tensor_gflop * volume.n_frames,
            unit_peak_gflops=peaks.unit_peak_gflops,
        )  # fmt: skip
        attrs = {
            "affine": np.asarray(volume.affine, np.float64),
            "voxel_size": np.asarray(volume.voxel_size, np.float64),
            "source": job.spec,
            "source_sha256": source_sha256,
            "pipeline": cfg.text,
            "volconv_version": volconv.__version__,
            "device": device_name(conv.device),
            **record,
        }
        if job.expanded.features:  # what each feature output is (volconv.bank.features)
            attrs["features"] = features_json(job.expanded.features)
        path = writer.finish(attrs)
    OPEN_WRITERS.discard(writer)
    stages = {"read": read_seconds, **stages, "write": writer.write_seconds, "wall": wall}
    return VolumeReport(
        source=job.spec, output=str(path), shape=tuple(int(s) for s in volume.shape),
        dtype=str(np.dtype(volume.dtype)), n_filters=len(job.outputs),
        extents=tuple(int(e) for e in job.kernels.shape[1:]), slab_depth=conv.plan.slab_depth,
        n_slabs=job.n_slabs, status="done", stages=stages, clipped=writer.clipped + writer.nans,
        resumed_slabs=kept, started_at=started_at, **record,
    )  # fmt: skip


def resumed(
    progress: Progress | None,
    work: list[tuple[int, int, int]],
    job: Job,
    on_slab: Callable[[Job], None] | None,
) -> tuple[int, list[tuple[int, int, int]]]:
    """How many slabs of ``work`` a resumed partial output holds already (also as
    ``job.resumed``), each counted as done for the progress bar (``on_slab``), and the slabs
    left to compute."""
    left = progress.remaining(work) if progress else work
    job.resumed = len(work) - len(left)
    for _ in range(job.resumed if on_slab else 0):
        on_slab(job)
    return job.resumed, left
