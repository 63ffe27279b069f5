"""The `volconv` commands (typer): run, validate, devices, filters, show, bench.

`volconv.cli` is the program around them (its start, the exit statuses, the one-line
errors); each command imports what it uses when it runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import typer
from rich.console import Console

from volconv.cli import UserError, _interrupted, _state
from volconv.errors import (
    NoDeviceError,
    one_line,
)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # help texts name [[bank.filter]] tables: plain text, not markup
    help="Banks of 3D/4D convolution filters on OpenCL, exactly scipy.ndimage.convolve.",
)


class _Stdout:
    """sys.stdout (looked up at each write, as rich does) that goes quiet when its reader
    leaves (``volconv run ... | head -1``): the run's outputs matter more than its lines, so
    the work goes on to the end."""

    closed = False  # the reader left

    def _call(self, method: str, *args: str) -> None:
        if self.closed:
            return
        try:
            getattr(sys.stdout, method)(*args)
        except BrokenPipeError:
            self.closed = True
            # Python would complain again when it flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    def write(self, text: str) -> int:
        self._call("write", text)
        return len(text)

    def flush(self) -> None:
        self._call("flush")

    def isatty(self) -> bool:
        return sys.stdout.isatty()

    def fileno(self) -> int:
        return sys.stdout.fileno()

    @property
    def encoding(self) -> str:
        return sys.stdout.encoding


console = Console(file=_Stdout())
err = Console(stderr=True)


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks.")) -> None:
    _state["debug"] = debug


def _debug_after(value: bool) -> bool:
    if value:  # `volconv run --debug FILE` as `volconv --debug run FILE`
        _state["debug"] = True
    return value


_DEBUG = typer.Option(False, "--debug", help="Show tracebacks.", callback=_debug_after,
                      is_eager=True)  # fmt: skip


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@app.command()
def devices(
    probe: bool = typer.Option(
        False, "--probe", help="Measure each device's FP32 rate with the FMA probe (seconds)."
    ),
    debug: bool = _DEBUG,
) -> None:
    """Every OpenCL platform and device with its theoretical FP32 peak."""
    from volconv.device.devices import list_devices, missing_platform_help, select_device
    from volconv.device.peak import measured_bandwidth, measured_peak
    from volconv.report import format_gflops

    found = list_devices()
    if not found:
        raise NoDeviceError(missing_platform_help())
    auto = select_device("auto")
    for d in found:
        chosen = (
            "  (auto)"
            if d.name == auto.name.strip() and d.platform == auto.platform.name.strip()
            else ""
        )
        console.print(
            f"[bold]{d.spec}  {d.name}[/bold]  [{d.kind}]{chosen}", highlight=False, soft_wrap=True
        )
        console.print(
            f"      platform   {d.platform} (driver {d.driver})", highlight=False, soft_wrap=True
        )
        console.print(
            f"      compute    {d.compute_units} units at {d.clock_mhz} MHz", soft_wrap=True
        )
        console.print(
            f"      memory     {_gib(d.global_mem)} global, {_gib(d.max_alloc)} max allocation, "
            f"{d.local_mem // 1024} KiB local",
            soft_wrap=True,
        )
        console.print(f"      FP32 peak  {d.peak}  ({d.peak.how})", highlight=False, soft_wrap=True)
        dev = select_device(d.spec)
        measured = measured_peak(dev, refresh=probe, probe=probe)
        copy = measured_bandwidth(dev, refresh=probe, probe=probe)
        how = "measured now" if probe else "cached; --probe measures again"
        if measured is not None:
            console.print(f"      FMA probe  {format_gflops(measured)}  ({how})", highlight=False,
                          soft_wrap=True)  # fmt: skip
        if copy is not None:
            console.print(f"      copy       {copy:.1f} GB/s  ({how})", highlight=False,
                          soft_wrap=True)  # fmt: skip


@app.command()
def filters(debug: bool = _DEBUG) -> None:
    """The filter types of [[bank.filter]] tables, their keys and defaults."""
    from volconv.bank.filters import describe_types

    console.print(describe_types(), highlight=False, markup=False, soft_wrap=True)


# -- run and validate: volconv.run.jobs and volconv.run.pipeline do the work ---------------
_PIPELINE = typer.Argument(..., metavar="PIPELINE.toml", help="The pipeline file.")
_SET = typer.Option(
    None, "--set", metavar="KEY=VALUE",
    help="Override a key of the pipeline file, e.g. --set bank.boundary=nearest or "
    "--set 'input.paths=[\"a.nii\"]'; the value is TOML, else text. Repeatable.",
)  # fmt: skip
_OVERWRITE = typer.Option(False, "--overwrite", help="Recompute outputs that already exist.")
_DEVICE = typer.Option(
    None, "--device", help="auto, gpu, cpu, a name fragment or platform:device (over run.device)."
)

_DEVICES = typer.Option(
    None, "--devices", metavar="all|LIST",
    help="One worker process per device: all, or specs as --device takes them, separated by "
    "commas (a spec may repeat, e.g. cpu,cpu) (over run.devices).",
)  # fmt: skip
_SCHEDULER = typer.Option(
    None, "--scheduler", metavar="ADDRESS",
    help="Send one task per input to this Dask scheduler, e.g. tcp://host:8786; each worker "
    "owns one device (over run.scheduler).",
)  # fmt: skip


@app.command()
def run(
    pipeline: str = _PIPELINE,
    set_: list[str] | None = _SET,
    overwrite: bool = _OVERWRITE,
    device: str | None = _DEVICE,
    devices: str | None = _DEVICES,
    scheduler: str | None = _SCHEDULER,
    report: str | None = typer.Option(
        None, "--report", metavar="FILE", help="Also write the summary table as JSON to FILE."
    ),
    debug: bool = _DEBUG,
) -> None:
    """Filter every input of the pipeline into its HDF5 file; print throughput per stage."""
    try:  # Ctrl-C from here on says so in one line, the imports' time included
        from volconv.device.driver import start_driver
        from volconv.device.programs import start_context
        from volconv.device.start import record_programs, start_programs

        # The OpenCL driver starts (the program started it already: volconv.cli), and then
        # the device's context is made and the programs the last run of this pipeline took
        # are loaded, in the background while the modules import and the pipeline is read
        # and planned (volconv.device.programs, volconv.device.start).
        start_driver()
        from volconv.config import load
        from volconv.device.devices import select_device

        cfg = load(pipeline, set_ or (), device=device, devices=devices, scheduler=scheduler)
        if cfg.scheduler:
            _need_batch_extra(cfg.scheduler)
        first = None  # the device this process filters on, as the run or the batch picks it
        with contextlib.suppress(Exception):  # a wrong spec: the run or the batch says so
            if cfg.devices == "one" and not cfg.scheduler:
                first = select_device(cfg.device)
            elif not cfg.scheduler:  # a local batch: this process filters on its first device
                from volconv.device.devices import every_device

                first = select_device((every_device() if cfg.devices == "all" else
                                       cfg.devices)[0])  # fmt: skip
            if first is not None:
                start_context(first)
                start_programs(first, cfg.source, cfg.text)
        from volconv.console import run_and_report

        since = _state["t0"] if isinstance(_state["t0"], float) else None
        result = run_and_report(cfg, console, overwrite=overwrite, report=report, since=since)
        if cfg.devices == "one" and not cfg.scheduler:  # for the next run's start and batch
            from volconv.run.model import remember_pace

            record_programs(result.device, cfg.source, cfg.text)
            remember_pace(cfg, result.reports, result.seconds, result.peak_gflops)
        elif first is not None:  # a local batch: its first process's, for the next batch
            record_programs(first, cfg.source, cfg.text)
    except ValueError as e:  # every one of USER_ERRORS is one
        from volconv.run.jobs import USER_ERRORS

        if not isinstance(e, USER_ERRORS):
            raise
        raise UserError(str(e)) from e  # the pipeline's, bank's, inputs' and writer's: exit 2
    except KeyboardInterrupt as e:  # here: typer would turn it into a silent exit 130
        _interrupted(e)
    if result.failed:  # named in stdout's table too; stderr is where a script looks
        for r in result.failed:
            why = r.reason if r.source in r.reason else f"{r.source}: {r.reason}"
            err.print(f"error: {one_line(why)}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _need_batch_extra(scheduler: str) -> None:
    """A batch on a scheduler runs on Dask distributed, the ``batch`` extra: without it, say
    what to install (exit 2, before any work). Local ``--devices`` need no Dask."""
    import importlib.util

    if importlib.util.find_spec("distributed") is None:
        raise UserError(f"--scheduler {scheduler} (or run.scheduler) runs a batch on Dask, "
                        "which is not installed: pip install 'volconv[batch]'")  # fmt: skip


@app.command()
def validate(
    pipeline: str = _PIPELINE,
    set_: list[str] | None = _SET,
    overwrite: bool = _OVERWRITE,
    device: str | None = _DEVICE,
    debug: bool = _DEBUG,
) -> None:
    """Check the pipeline, its bank and every input without computing; print the plan."""
    try:  # Ctrl-C from here on says so in one line, the imports' time included
        from volconv.config import load
        from volconv.console import show_plan

        show_plan(load(pipeline, set_ or (), device=device), console, overwrite=overwrite)
    except ValueError as e:  # every one of USER_ERRORS is one
        from volconv.run.jobs import USER_ERRORS

        if not isinstance(e, USER_ERRORS):
            raise
        raise UserError(str(e)) from e
    except KeyboardInterrupt as e:  # here: typer would turn it into a silent exit 130
        _interrupted(e, "interrupted; validate writes nothing")


@app.command()
def show(
    output: str = typer.Argument(
        ..., metavar="OUTPUT", help="A volconv output: .h5, .nii, .nii.gz or a .zarr folder."
    ),
    png: str | None = typer.Option(None, "--png", help="Where to write (default OUTPUT.png)."),
    frame: int | None = typer.Option(
        None, "--frame", min=0, help="The frame of a 4D output to draw (default: the middle one)."
    ),
    debug: bool = _DEBUG,
) -> None:
    """A PNG of the central slices of every output, with names and value ranges."""
    from volconv.show import show as draw

    zarr = output.rstrip("/").lower().endswith(".zarr") and os.path.isdir(output)
    if not (os.path.isfile(output) or zarr):
        from volconv.checks import file_kind  # numpy: not for --help

        kind = file_kind(output)
        raise UserError(f"{output}: " + ("no such file" if kind == "nothing" else
                                         f"is {kind}, not a volconv output file"))  # fmt: skip
    try:
        path = draw(output, png, frame=frame)
    except (OSError, ValueError) as e:
        raise UserError(f"{output}: {e}" if output not in str(e) else str(e)) from e
    console.print(f"wrote {path}", highlight=False, markup=False, soft_wrap=True)


# -- bench: volconv.bench does the work ---------------------------------------------------
@app.command()
def bench(
    size: str = typer.Option("256", help="Volume edge, or three edges: 256 or 256,256,128."),
    n: int = typer.Option(8, "--n", help="Filters in the bank."),
    extent: str = typer.Option("7", help="Kernel extent, or three: 7 or 7,7,5."),
    mode: str = typer.Option("reflect", help="Boundary mode (scipy.ndimage's names)."),
    dtype: str = typer.Option("uint8", help="Voxel type: uint8, int8, uint16, int16, float32."),
    device: str | None = typer.Option(
        None, "--device", help="auto, gpu, cpu, a name fragment or platform:device."
    ),
    repeats: int = typer.Option(10, min=1, help="Timed launches per point (median)."),
    sweep_n: str = typer.Option("1,2,4,8,13,16,32", help="N values, plan's own knobs ('' skips)."),
    sweep_unroll: str = typer.Option(
        "1,2,4,8,16,24,32", help="CONV_UNROLL values at --n ('' skips)."
    ),
    sweep_local: str = typer.Option(
        "8x8,16x8,16x16,32x4", help="Work-group shapes z x y, crossed with --sweep-unroll."
    ),
    peers: bool = typer.Option(False, "--peers", help="Also time scipy, torch and cupyx."),
    peer_size: int = typer.Option(64, min=1, help="Volume edge for scipy (it is slow)."),
    json_path: str | None = typer.Option(None, "--json", metavar="FILE", help="Write JSON."),
    plot: str | None = typer.Option(None, "--plot", metavar="PREFIX", help="PREFIX-*.png."),
    refresh_peak: bool = typer.Option(False, "--refresh-peak", help="Run the FMA probe again."),
    peak_only: bool = typer.Option(False, "--peak-only", help="Only the device's peaks."),
    tune: bool = typer.Option(
        False,
        "--tune",
        help="Find the fastest engine and knobs for this bank shape on the "
        "device and cache them: later plans of that shape take them (no sweeps).",
    ),
    debug: bool = _DEBUG,
) -> None:
    """Kernel throughput on a synthetic volume as a fraction of the device's peak."""
    from volconv import bench as b  # loaded for this command only
    from volconv.bank.spec import MAX_EXTENT
    from volconv.checks import check_mode
    from volconv.device.devices import select_device
    from volconv.plan.direct import CL_TYPES, MAX_FILTERS
    from volconv.plan.knobs import MAX_UNROLL
    from volconv.report import write_json

    try:
        work = b.Work(
            b.parse_shape(size, "--size"), n, b.parse_shape(extent, "--extent", hi=MAX_EXTENT),
            mode, dtype,
        )  # fmt: skip
        ns = b.parse_ints(sweep_n, "--sweep-n", hi=MAX_FILTERS)
        unrolls = b.parse_ints(sweep_unroll, "--sweep-unroll", hi=MAX_UNROLL)
        locals_ = b.parse_local_sizes(sweep_local, "--sweep-local")
    except ValueError as e:
        raise UserError(str(e)) from e
    if not 1 <= n <= MAX_FILTERS:
        raise UserError(f"--n: {n} is outside 1..{MAX_FILTERS}")
    try:
        check_mode(mode, "--mode")
    except ValueError as e:
        raise UserError(str(e)) from e
    if dtype not in {str(t) for t in CL_TYPES}:
        raise UserError(f"--dtype: {dtype!r} is not one of {', '.join(map(str, CL_TYPES))}")
    itemsize = next(t.itemsize for t in CL_TYPES if str(t) == dtype)
    volume_bytes = math.prod(work.shape) * itemsize
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if volume_bytes > memory // 2:  # before numpy tries to allocate it
        raise UserError(f"--size {size}: the volume alone takes {_gib(volume_bytes)}; this "
                        f"machine has {_gib(memory)} of memory: give a smaller size")  # fmt: skip
    from volconv.checks import file_kind

    if json_path is not None and file_kind(json_path) not in ("nothing", "a file"):
        raise UserError(f"--json {json_path}: is {file_kind(json_path)}; give a file name")

    dev = select_device(device)
    if peak_only:
        peaks = b.peaks_of(dev, refresh=refresh_peak)
        result = {"device": b.device_record(dev), "peak": b.peak_record(peaks)}
    elif tune:
        from volconv.plan.tune import point_line, tune_bank, winner_line

        def show(point: dict) -> None:
            console.print(f"tune         {point_line(point)}", highlight=False, markup=False,
                          soft_wrap=True)  # fmt: skip

        console.print(f"volconv bench --tune on {dev.name.strip()}: {work}", highlight=False,
                      soft_wrap=True)  # fmt: skip
        b.peaks_of(dev, refresh=refresh_peak)  # the probe's rate, recorded beside the winner
        result = tune_bank(work, device=dev, repeats=repeats, progress=show)
        console.print(f"tuned        {winner_line(result)}\nwrote {result['cache']}",
                      highlight=False, markup=False, soft_wrap=True)  # fmt: skip
        if json_path:
            write_json(result, json_path)
            console.print(f"wrote {json_path}", highlight=False)
        return
    else:

        def progress(section: str, result: dict) -> None:
            if section == "peers":
                for p in result["peers"]:
                    console.print(
                        f"peer         {b.peer_line(p)}",
                        highlight=False,
                        markup=False,
                        soft_wrap=True,
                    )
            else:
                last = result[section] if section == "default" else result[section][-1]
                console.print(
                    f"{section:<13}{b.point_line(last)}",
                    highlight=False,
                    markup=False,
                    soft_wrap=True,
                )
            if json_path:
                write_json(result, json_path)  # after every point: a cut run keeps its data

        console.print(
            f"volconv bench on {dev.name.strip()}: {work}", highlight=False, soft_wrap=True
        )
        result = b.run_bench(
            work, device=dev, repeats=repeats, sweep_n=ns, sweep_unroll=unrolls,
            sweep_local=locals_, peers=peers, scipy_size=peer_size, refresh_peak=refresh_peak,
            progress=progress,
        )  # fmt: skip
        if plot:
            for path in b.write_plots(result, plot):
                console.print(f"wrote {path}", highlight=False)
    if json_path:
        write_json(result, json_path)
        console.print(f"wrote {json_path}", highlight=False)
    console.print(b.summary(result), highlight=False, markup=False, soft_wrap=True)
