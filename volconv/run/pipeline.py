"""The pipeline: a validated `Config` -> planned jobs -> one output file per input.

`plan_jobs` opens every input's header, builds its bank (once per voxel size), plans its
convolution and checks its output path without computing anything: what `volconv validate`
prints, and where every mistake of the user's is found before any work. `run_one` runs one
job end to end on one device (read -> kernel -> write -> record) and returns its record;
`run` is its simplest caller, one device and the jobs in order. A reader thread fetches the
next slab's rows while the device works on this one, and the writer's thread writes the
previous one.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache, partial
from pathlib import Path
from queue import Empty, SimpleQueue

import numpy as np
import pyopencl as cl

import volconv
from volconv.bank.features import Expanded, expand, features_json
from volconv.bank.filters import Filter, build_bank, stack_kernels
from volconv.bank.outputs import Output
from volconv.bank.spec import BankError
from volconv.checks import as_float32, file_kind
from volconv.config import Config, PipelineError
from volconv.device.devices import DeviceError, device_name, select_device
from volconv.device.peak import fp32_peak, measured_bandwidth, measured_peak, tensor_peak
from volconv.engines.convert import device_encodes, output_scale
from volconv.engines.direct import STAGES
from volconv.engines.nonfinite import APPLY_BYTES, OverridePlan
from volconv.engines.padder import frame_bytes
from volconv.engines.separable import (
    Choice,
    SeparableConvolver,
    SeparablePlan,
    make_separable_plan,
    plan_bank,
    plan_paths,
)
from volconv.errors import OutputWriteError
from volconv.output import (
    OutputError,
    OutputExistsError,
    ResponseWriter,
    Space,
    backlog_bytes,
    check_output_path,
    holds,
    is_complete,
    is_regular,
    open_writer,
    slabs_in_flight,
)
from volconv.output import made as made_with
from volconv.plan.direct import MAX_EXTENT, MAX_FILTERS, MAX_SEPARABLE_FILTERS, make_plan
from volconv.report import VolumeReport, is_report, throughput, work_gflop
from volconv.run.inputs import expand_inputs, open_volume, split_spec
from volconv.run.resume import Progress, fingerprint
from volconv.run.volume import CorruptInputError, InputError, Volume

# The errors that are the user's: the CLI turns them into exit status 2 and one line.
USER_ERRORS = (PipelineError, BankError, InputError, OutputError)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: ``signum``) stopped the run; the message says what was kept and
    how to resume."""

    signum = signal.SIGINT


# -- planning: headers, banks, plans, outputs; no compute ---------------------------------
@dataclass
class Job:
    """One input: its volume (header open), bank, plan and output.

    ``filters`` is the bank as written; ``expanded`` adds the filters only derived features
    read (`run_filters`, what the plan covers) and names the file's outputs (`outputs`: the
    bank's responses, then the features')."""

    spec: str
    volume: Volume
    filters: list[Filter]
    kernels: np.ndarray  # (N, sx, sy, sz) float64, as stored: one per output (`stored_kernels`)
    plan: SeparablePlan  # each filter's path (direct, separable, low-rank) and the slabs
    output: Path
    complete: bool  # the output exists, is complete and was made from this input and bank
    whole_frames: bool = False  # read each frame whole, in the file's order, then slab it
    host_bytes: int = 0  # the most host memory the run holds for it
    device_bytes: int = 0  # the most device memory it holds (`device_bytes`)
    resumed: int = 0  # slabs an interrupted run's partial output held (volconv.run.resume)
    scale: float = 1.0  # uint8's quantisation of this output (`output_scale`)
    offset: float = 0.0
    expanded: Expanded | None = None  # default: the bank alone

    def __post_init__(self) -> None:
        if self.expanded is None:
            self.expanded = expand(self.filters, ())

    @property
    def outputs(self) -> list[Output]:
        """The volumes the file stores, in order: N is their count."""
        return self.expanded.outputs

    @property
    def run_filters(self) -> list[Filter]:
        """Every filter the device runs: the bank's, then those only features read."""
        return self.expanded.filters

    @property
    def names(self) -> list[str]:
        return [o.name for o in self.outputs]

    @property
    def extents(self) -> list[tuple[int, ...]]:
        """Each output's own extent, before padding to the common one: a response's kernel's,
        (1, 1, 1) for a feature's."""
        return [tuple(int(e) for e in k) for k in self.expanded.stored_kernels()[1]]

    @property
    def shape3(self) -> tuple[int, int, int]:
        return spatial_shape(self.volume)

    @property
    def n_slabs(self) -> int:
        return self.plan.n_slabs * self.volume.n_frames

    @property
    def gflop(self) -> float:
        """The useful work of the whole input (`volconv.report.work_gflop`): every filter
        the device runs, at its own extent."""
        extents = [f.kernel.shape for f in self.run_filters]
        return work_gflop(extents, int(np.prod(self.volume.shape)))

    def skipped(self, reason: str = "") -> VolumeReport:
        return VolumeReport.skipped(self.spec, str(self.output), self.volume.shape,
                                    len(self.outputs), reason)  # fmt: skip

    def failed(self, reason: str) -> VolumeReport:
        return VolumeReport.failed(self.spec, str(self.output), self.volume.shape,
                                   len(self.outputs), reason)  # fmt: skip


def choose_device(cfg: Config) -> cl.Device:
    """The device ``run.device`` (or ``--device``, or ``PYOPENCL_CTX``) names; naming one that
    is not there is the user's mistake, having no OpenCL device at all is not."""
    where = "--device" if cfg.device_from_cli else f"{cfg.source}: run.device ="
    try:
        return select_device(cfg.device, source=where)
    except DeviceError as e:
        raise PipelineError(str(e)) from None


def output_path(cfg: Config, volume: Volume) -> Path:
    """``output.path`` for ``volume``, relative to the pipeline file's folder."""
    name = cfg.output.format(stem=volume.stem, parent=volume.parent, pipeline=cfg.source.stem)
    path = Path(name).expanduser()
    # normpath folds "pipelines/../out" into "out" for the messages (links are not resolved)
    return Path(os.path.normpath(path if path.is_absolute() else cfg.base_dir / path))


def plan_jobs(
    cfg: Config, device: cl.Device, *, overwrite: bool = False, report: str | Path | None = None
) -> list[Job]:
    """Open every input's header, build its bank, plan it and check its output path.

    Every mistake of the user's raises here, before any work: a bad input, a bank too large,
    two inputs writing one output, an output path that holds something else, or a complete
    output made from another input or bank (unless ``overwrite``), an output or ``report``
    path naming a file the run reads or writes (never replaced, whatever ``overwrite``).
    """
    try:
        specs = expand_inputs(list(cfg.paths), cfg.base_dir)
    except InputError as e:
        raise PipelineError(f"{cfg.source}: input.paths: {e}") from None
    claimed = claimed_files(cfg, specs)
    # what no output may replace: the files the run reads, and its report
    taken = (
        {**claimed, Path(report).resolve(): f"the --report file {report}"} if report else claimed
    )
    banks: dict[tuple[float, ...], tuple[list[Filter], np.ndarray, Expanded]] = {}
    choices: dict[int, list[Choice]] = {}
    jobs: list[Job] = []
    seen: dict[Path, str] = {}
    for spec in specs:
        volume = open_volume(spec, external=cfg.external)
        filters, kernels, expanded = _bank_for(cfg, volume, spec, banks)
        if id(filters) not in choices:  # the path of each filter: once per bank
            choices[id(filters)] = plan_paths(expanded.filters, device,
                                              separable=expanded.separable)  # fmt: skip
        try:
            plan = make_separable_plan(
                expanded.filters, spatial_shape(volume), volume.dtype, cfg.boundary, cfg.cval,
                device, choices=choices[id(filters)], slab_depth=cfg.slab_depth, stream=True,
                **expanded.plan_sizes(),
            )  # fmt: skip
        except ValueError as e:
            raise PipelineError(f"{spec}: {e}") from None
        out = output_path(cfg, volume)
        if out in seen:
            hint = "add {parent}" if "{stem}" in cfg.output else "use {stem} (and {parent})"
            raise PipelineError(
                f"{cfg.source}: output.path = {cfg.output!r} gives {out} for both {seen[out]} "
                f"and {spec}; {hint}"
            )
        seen[out] = spec
        check_output(cfg, out, taken)
        job = Job(spec, volume, filters, kernels, plan, out, complete=False, expanded=expanded)
        job.scale, job.offset = output_scale(cfg, volume, kernels)
        fit_host_memory(job, cfg, device)
        if out.exists() and not overwrite:
            if not is_complete(out):
                raise PipelineError(
                    f"output {out} exists and is not a complete volconv output (it holds "
                    f"{holds(out)}); move it away or pass --overwrite to replace it"
                )
            if differs := differences(job, cfg):
                raise PipelineError(
                    f"output {out} is complete but was made with another {differs}; "
                    "pass --overwrite to recompute it"
                )
            job.complete = True
        jobs.append(job)
    if report is not None:  # an output at the report's path was refused above
        check_report_path(Path(report), claimed)
    return jobs


def claimed_files(cfg: Config, specs: list[str]) -> dict[Path, str]:
    """The files a run reads, which no output or report of it may replace, each resolved
    (links followed) with what it is in words: the pipeline file, its custom kernels and
    every input."""
    claimed = {cfg.source.resolve(): f"the pipeline file {cfg.source}"}
    for i, table in enumerate(cfg.filters):
        if table.get("type") == "custom" and isinstance(table.get("path"), str):
            kernel = cfg.base_dir / Path(table["path"]).expanduser()
            claimed[kernel.resolve()] = f"the custom kernel of bank.filter[{i}] ({kernel})"
    for spec in specs:
        claimed[Path(split_spec(spec)[0]).resolve()] = f"the input {spec}"
    return claimed


def check_output(cfg: Config, out: Path, claimed: dict[Path, str]) -> None:
    """Refuse an output path that cannot be written or that names a file the run reads (or
    its report): never replaced, --overwrite or not."""
    try:
        check_output_path(out)  # a folder, a FIFO, a name too long, an unwritable folder
    except OutputError as e:
        raise OutputError(f"{e} (output.path = {cfg.output!r})") from None
    if (what := claimed.get(out.resolve())) is not None:
        raise PipelineError(
            f"{cfg.source}: output.path = {cfg.output!r} gives {out}, which is {what}; "
            "volconv never replaces it"
        )


def check_report_path(report: Path, claimed: dict[Path, str]) -> None:
    """Refuse a ``--report`` file that would replace a file the run reads or writes, or
    anything but a volconv report: it is written after the work, so check it before."""
    if (what := claimed.get(report.resolve())) is not None:
        raise PipelineError(f"--report {report}: is {what}; give the report another name")
    if os.path.lexists(report) and not os.path.islink(report) and not is_regular(report):
        raise PipelineError(f"--report {report}: is {file_kind(report)}; give a file name")
    if is_regular(report) and not is_report(report):
        raise PipelineError(
            f"--report {report}: exists and is not a volconv report (it holds "
            f"{holds(report)}); move it away or give another name"
        )


# Page-locked slab buffers per convolver: one the device downloads into while the writer
# holds up to two (its queue), so downloads run at the bus's speed rather than page-faulting
# fresh memory (benchmarks/README.md, "The measurements behind the defaults").
PINNED_BUFFERS = 3
# Bytes of one pinned slab buffer at most: page-locking costs time at the start, a deeper slab
# makes neither the bus nor the disk faster, and a shallower one keeps the run's memory down.
MAX_PINNED_BYTES = 128 * 2**20
# A frame is read whole, once, in the file's own layout, and goes to the device as it is (a
# NIfTI is x-fastest: reading slabs along x would stride through the file, and transposing on
# the host costs more than reading; pad.cl gathers through strides instead; a .nii.gz is
# decompressed once), when the file maps (read as used) or the frame takes at most this share
# of host_memory; other frames are read slab by slab.
WHOLE_FRAME_SHARE = 4


def host_bytes(job: Job, cfg: Config, depth: int, device: cl.Device) -> int:
    """The host memory a run of ``job`` holds at slab depth ``depth`` (SPEC "Memory"): the
    pinned slab buffers (of the stored type where the device converts, else float32), a
    float32 slab converted on the host (every slab where the device does not convert; where
    it does, a slab whose source holds NaN or Inf) for each slab the writer has in flight, the
    writer's compressed chunks (`volconv.output.backlog_bytes`), the last slab padded to whole
    chunks where it is shorter, two slabs of source rows (one read ahead), the whole frame if
    it is read whole, the responses of a direct group whose filters are not neighbours in the
    bank (gathered into place), a float source's NaN and Inf override (`nonfinite_bytes`:
    the data may hold them), and on a CPU device its buffers, which are host memory too."""
    ny, nz = job.shape3[1:]
    slab = len(job.outputs) * depth * ny * nz
    stored = np.dtype(cfg.dtype).itemsize
    item = np.dtype(job.volume.dtype).itemsize
    on_device = device_encodes(device, cfg.dtype)
    total = PINNED_BUFFERS * slab * pinned_itemsize(cfg, device)
    in_flight = slabs_in_flight(cfg.compression)  # the writer's, each converted on its own
    if stored != 4 and (not on_device or np.dtype(job.volume.dtype).kind == "f"):
        total += in_flight * slab * (4 if on_device else stored)
    total += backlog_bytes(slab * stored, cfg.compression)
    if job.shape3[0] % depth:  # the writer pads the last slab's chunks to whole ones
        total += slab * stored
    total += 2 * (depth + sum(job.plan.extents[:1]) - 1) * ny * nz * item
    if job.whole_frames:
        total += math.prod(job.shape3) * item
    scattered = [len(g) for g in job.plan.groups if list(g) != list(range(g[0], g[-1] + 1))]
    total += max(scattered, default=0) * depth * ny * nz * 4
    on_host, on_cpu = nonfinite_bytes(job, depth, device)
    total += on_host
    tensor_host, tensor_device = tensor_bytes(job, depth, device)
    total += tensor_host
    if device.type & cl.device_type.CPU:
        total += replace(job.plan, slab_depth=depth).device_bytes + on_cpu + tensor_device
    return total


def tensor_bytes(job: Job, depth: int, device: cl.Device) -> tuple[int, int]:
    """The memory the structure tensors (`volconv.engines.features.StructureTensorStage`) take at
    slab depth ``depth``, as ``(host, device)``: on the host the gradients over the product
    rows, a product in float64 and one in float32, the six entries and the eigenvalues of a
    slab (a slab holding NaN or Inf goes through the host); on the device the gradients'
    and the second smoothing's convolvers, the gradients over the product rows, S's entries
    and the eigenvalues."""
    n0, ny, nz = job.shape3
    host = device_total = 0
    for feat, _ in job.expanded.tensors:
        r = (feat.rho_filter.kernel.shape[0] - 1) // 2
        rows = min(n0, depth + 2 * r)
        host += (3 * rows + 3 * rows + 9 * depth) * ny * nz * 4
        for filters, dtype in ((feat.inputs, job.volume.dtype), ((feat.rho_filter,), np.float32)):
            plan = make_separable_plan(
                list(filters), job.shape3, dtype, job.plan.mode, job.plan.cval, device,
                choices=plan_bank(list(filters), force="separable"), slab_depth=depth,
                fused=False,
            )  # fmt: skip
            device_total += plan.device_bytes
        device_total += (9 * depth + 3 * rows) * ny * nz * 4  # S and eigenvalues; gradients
        host += 2 * min(n0, rows + feat.inputs[0].kernel.shape[0]) * ny * nz * 4  # overrides
    return host, device_total


def override_banks(job: Job) -> list[np.ndarray]:
    """The banks a run of ``job`` builds a non-finite override for (`volconv.engines.nonfinite`), as
    `volconv.engines.separable.SeparableConvolver` does: its separable filters' (stacked to their
    common extent), then each direct group's."""
    kernels = [f.kernel for f in job.run_filters]
    if any(max(k.shape) > MAX_EXTENT for k in kernels):  # refused on a non-finite slab
        return []
    slots = [f for f, c in enumerate(job.plan.choices) if c.path != "direct"]
    banks = [stack_kernels([kernels[f] for f in slots])] if slots else []
    return banks + [np.stack([kernels[f] for f in g]) for g in job.plan.groups]


def nonfinite_bytes(job: Job, depth: int, device: cl.Device) -> tuple[int, int]:
    """The memory a slab of ``depth`` rows whose float source holds NaN or Inf takes beyond a
    finite slab's (``(0, 0)`` for integer sources, which never do), as ``(host, buffers)``.

    ``host``: the source rows' finite part and a second copy of them (the override's rows, or
    a direct group's), the separable responses gathered for the override, and the most an
    override's `~volconv.engines.nonfinite.NonFiniteOverride.apply` holds at a time (bounded, in
    sub-slabs: `volconv.engines.nonfinite.OverridePlan.host_bytes`). ``buffers``: the counting
    convolvers' buffers (uint8 0/1 banks at the slab's depth), on the device; host memory
    too on a CPU device."""
    if np.dtype(job.volume.dtype).kind != "f":
        return 0, 0
    item = np.dtype(job.volume.dtype).itemsize
    n0, ny, nz = job.shape3
    rows = min(n0, depth + job.plan.extents[0] - 1)
    host = rows * ny * nz * (2 * item + 1)
    host += job.plan.n_separable * depth * ny * nz * 4
    # the features of such a slab on the host, in float64: H's 9 entries and 3 eigenvalues
    host += 12 * 8 * depth * ny * nz * bool(job.expanded.device)
    buffers, applies = 0, [0]
    for kernels in override_banks(job):
        plan = OverridePlan.of(kernels)
        sub = plan.depth(job.shape3, depth, item, APPLY_BYTES)
        applies.append(plan.host_bytes(job.shape3, sub, item))
        for bank in plan.banks:
            counting = make_plan(job.shape3, np.dtype(np.uint8), bank.shape[1:], len(bank),
                                 job.plan.mode, 0.0, device, slab_depth=depth)  # fmt: skip
            buffers += counting.device_bytes
    return host + max(applies), buffers  # the overrides apply one after the other


def pinned_itemsize(cfg: Config, device: cl.Device) -> int:
    """Bytes per value of the pinned slab buffers: the stored type where the device converts,
    else float32."""
    return np.dtype(cfg.dtype).itemsize if device_encodes(device, cfg.dtype) else 4


def fit_host_memory(job: Job, cfg: Config, device: cl.Device) -> None:
    """Whether ``job`` reads whole frames, and its slab depth made to fit ``host_memory``."""
    frame = math.prod(job.shape3) * np.dtype(job.volume.dtype).itemsize
    job.whole_frames = job.volume.mapped or frame * WHOLE_FRAME_SHARE <= cfg.host_memory
    row = len(job.outputs) * math.prod(job.shape3[1:]) * pinned_itemsize(cfg, device)
    depth = job.plan.slab_depth
    if cfg.slab_depth is None:  # an expert's slab_depth is taken as given, if it fits
        depth = min(depth, max(1, MAX_PINNED_BYTES // row))
    if host_bytes(job, cfg, depth, device) > cfg.host_memory:  # the deepest slab that fits
        fits, over = 1, depth  # host_bytes grows with the depth
        while over - fits > 1:
            mid = (fits + over) // 2
            if host_bytes(job, cfg, mid, device) <= cfg.host_memory:
                fits = mid
            else:
                over = mid
        depth = fits
    need = host_bytes(job, cfg, depth, device)
    if need > cfg.host_memory:
        raise PipelineError(
            f"{cfg.source}: run.host_memory = {cfg.host_memory} bytes holds no slab of "
            f"{job.spec} ({need} bytes at one row)"
        )
    if cfg.slab_depth is None or depth < job.plan.slab_depth:
        job.plan = replace(job.plan, slab_depth=depth)
    job.host_bytes = host_bytes(job, cfg, job.plan.slab_depth, device)
    job.device_bytes = device_bytes(job, device)


def device_bytes(job: Job, device: cl.Device, frame_limit: int | None = None) -> int:
    """The device memory a run of ``job`` holds: its plan's buffers, a float source's
    counting convolvers (`nonfinite_bytes`: the data may hold NaN or Inf), and the whole
    frame where it is read whole and uploads as it is (an integer frame of at most
    ``frame_limit`` bytes, default `volconv.engines.padder.frame_bytes`: the `Padder` keeps it
    on the device)."""
    frame = math.prod(job.shape3) * np.dtype(job.volume.dtype).itemsize
    limit = frame_bytes(device) if frame_limit is None else frame_limit
    kept = job.whole_frames and np.dtype(job.volume.dtype).kind in "iu" and frame <= limit
    counting = nonfinite_bytes(job, job.plan.slab_depth, device)[1]
    tensors = tensor_bytes(job, job.plan.slab_depth, device)[1]
    return job.plan.device_bytes + counting + tensors + (frame if kept else 0)


def spatial_shape(volume: Volume) -> tuple[int, int, int]:
    """(x, y, z) of a 3D or 4D volume: what each frame's convolution sees."""
    return tuple(int(s) for s in volume.shape[:3])  # type: ignore[return-value]


def _bank_for(
    cfg: Config,
    volume: Volume,
    spec: str,
    banks: dict[tuple[float, ...], tuple[list[Filter], np.ndarray, Expanded]],
) -> tuple[list[Filter], np.ndarray, Expanded]:
    """The bank for ``volume``: the one validation built, or, where a sigma is in mm, one
    built per voxel size; the kernels stored (one per output) and the bank with its
    features (`volconv.bank.features.expand`)."""
    voxel = tuple(float(v) for v in volume.voxel_size[:3]) if cfg.bank_in_mm else ()
    if voxel not in banks:
        filters = list(cfg.bank)
        if cfg.bank_in_mm:
            try:
                filters = build_bank([dict(f) for f in cfg.filters], cfg.size, voxel_size=voxel,
                                     base_dir=cfg.base_dir, units=cfg.units,
                                     voxel_unknown=volume.voxel_unknown)  # fmt: skip
            except BankError as e:
                raise PipelineError(f"{cfg.source}: {e} (for {spec})") from None
        if len(filters) > MAX_FILTERS:  # gabor entries count twice
            raise PipelineError(
                f"{cfg.source}: bank.filter: {len(filters)} filters; one run takes at most "
                f"{MAX_FILTERS} (a gabor entry makes two): split the bank into two pipelines"
            )
        expanded = expand(filters, cfg.features)
        if len(expanded.filters) > MAX_SEPARABLE_FILTERS:
            raise PipelineError(
                f"{cfg.source}: bank.feature: the bank and the filters its features read make "
                f"{len(expanded.filters)} filters; one run takes at most "
                f"{MAX_SEPARABLE_FILTERS}: split the features into two pipelines"
            )
        banks[voxel] = filters, expanded.stored_kernels()[0], expanded
    return banks[voxel]


def differences(job: Job, cfg: Config) -> str:
    """What differs between how the complete output of ``job`` was made and how this run
    would make it (SPEC.md: the same input, SHA-256, and the same bank, boundary, cval and
    output type), as words for a message; empty when nothing does."""
    try:
        made = made_with(job.output)  # volconv.output: whatever the format
    except (OSError, KeyError, ValueError) as e:
        return f"layout ({e})"
    wanted = {
        "filter names": job.names,
        "bank": np.asarray(job.kernels, np.float32),
        "boundary": cfg.boundary,
        "cval": cfg.cval,
        "output dtype": cfg.dtype,
        "scale": job.scale,
        "offset": job.offset,
        "features": features_json(job.expanded.features),
    }
    for what, value in wanted.items():
        old = made[what]
        same = (
            old.shape == value.shape and np.array_equal(old, value)
            if isinstance(value, np.ndarray)
            else old == value
        )
        if not same:
            quiet = ("bank", "filter names", "features")
            shown = "" if what in quiet else f" ({old!r}, now {value!r})"
            return f"{what}{shown}"
    if made["input"] != job.volume.sha256():  # last: it reads the whole input
        return f"input (SHA-256 of {job.spec} changed)"
    return ""


# -- running ------------------------------------------------------------------------------
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
            self._cache[key] = conv, PinnedSlabs(conv.pinned_slab, PINNED_BUFFERS)
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
        except CorruptInputError as e:
            return job.failed(str(e))
        except STOPS_THE_RUN:
            raise
        except Exception as e:  # this input's own trouble: the others go on (exit status 1)
            return job.failed(f"{type(e).__name__}: {e}")
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


# Writers open in this process: Ctrl-C removes their temporary files from the main thread
# while a slab may still be on the device.
_OPEN_WRITERS: set[ResponseWriter] = set()
_STOP = threading.Event()


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
    _OPEN_WRITERS.add(writer)
    with writer, ThreadPoolExecutor(2, thread_name_prefix="volconv-read") as pool:
        kept, work = resumed(progress, work, job, on_slab)
        sha: Future[str] = pool.submit(digest)  # the whole file once, beside the work
        if progress:
            sha.add_done_callback(progress.input_known)
        pending = pool.submit(read, *work[0]) if work else None  # None: every slab was kept
        try:
            for i, (t, a, b) in enumerate(work):
                if _STOP.is_set():
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
    _OPEN_WRITERS.discard(writer)
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


# -- Ctrl-C --------------------------------------------------------------------------------
def interruptible(fn: Callable[..., VolumeReport], *args: object, **kwargs: object):
    """``fn(*args, **kwargs)`` in a worker thread, so that the main thread stays free to
    answer Ctrl-C within a fraction of a second even while a long kernel runs (a blocking
    OpenCL wait holds the main thread in C, where Python's signal handlers cannot run).

    On Ctrl-C the writers open stop here, from the main thread, keeping their temporary files
    and progress for a rerun to resume (with ``--overwrite``, removing them), and
    `Interrupted` is raised; the worker (a daemon thread) is abandoned with its kernel.
    """
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # raised again in the main thread
            box["error"] = e

    worker = threading.Thread(target=target, name="volconv-run", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.05)
        if _STOP.is_set() and worker.is_alive():
            for writer in list(_OPEN_WRITERS):
                if writer.progress is not None:
                    writer.keep()  # volconv.run.resume: what is on disk stays, for a rerun
                else:
                    writer.__exit__(Interrupted, None, None)  # removes its temporary file
            _OPEN_WRITERS.clear()
            raise Interrupted
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


@contextmanager
def stop_on_ctrl_c(reports: list[VolumeReport], resumable: bool = True) -> Iterator[None]:
    """Ctrl-C (or SIGTERM) stops the run at once: `Interrupted` says which outputs are
    complete, that the one in progress keeps its complete slabs (``resumable``; else it is
    removed) and how to resume. A second signal falls back to Python's own handling."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = (signal.SIGINT, signal.SIGTERM)

    def stop(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum))
        _STOP.set()
        for s, handler in zip(signums, previous, strict=True):
            signal.signal(s, handler)

    _STOP.clear()
    received: list[signal.Signals] = []
    previous = [signal.signal(s, stop) for s in signums]
    try:
        yield
        if _STOP.is_set():  # after the last slab of an input, before the next one
            raise Interrupted
    except KeyboardInterrupt as e:
        done = sum(r.status in ("done", "skipped") for r in reports)
        kept = (
            "the one in progress keeps its complete slabs (a hidden partial file beside it)"
            if resumable
            else "the one in progress was removed (--overwrite)"
        )
        error = Interrupted(
            f"interrupted: {done} output(s) complete and kept; {kept}; "
            "run the same command again to resume"
        )
        error.signum = received[0] if received else signal.SIGINT
        raise error from e
    finally:
        for s, handler in zip(signums, previous, strict=True):
            signal.signal(s, handler)
        _STOP.clear()
