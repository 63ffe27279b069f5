"""Planning: a validated `Config` -> one `Job` per input, without computing anything.

`plan_jobs` opens every input's header, builds its bank (once per voxel size), plans its
convolution, sizes it to the memory (`volconv.run.memory`) and checks its output path: what
`volconv validate` prints, and where every mistake of the user's is found before any work.
`differences` says how a complete output was made otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyopencl as cl

from volconv.bank.features import Expanded, expand, features_json
from volconv.bank.filters import Filter, build_bank
from volconv.bank.outputs import Output
from volconv.bank.spec import BankError
from volconv.checks import file_kind
from volconv.config import Config, PipelineError
from volconv.device.devices import DeviceError, select_device
from volconv.engines.convert import output_scale
from volconv.output import OutputError, check_output_path, holds, is_complete, is_regular
from volconv.output import made as made_with
from volconv.plan.direct import MAX_FILTERS, MAX_SEPARABLE_FILTERS
from volconv.plan.separable import Choice, SeparablePlan, make_separable_plan, plan_paths
from volconv.report import VolumeReport, is_report, work_gflop
from volconv.run.inputs import expand_inputs, open_volume, split_spec
from volconv.run.memory import fit_host_memory
from volconv.run.volume import InputError, Volume

# The errors that are the user's: the CLI turns them into exit status 2 and one line.
USER_ERRORS = (PipelineError, BankError, InputError, OutputError)


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
        the outputs' definitions apply, at its own extent (`Expanded.work_extents`)."""
        return work_gflop(self.expanded.work_extents, int(np.prod(self.volume.shape)))

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
