"""The `volconv` command line (typer).

Exit status: 0 done; 2 the user's mistake (one clear line, no traceback); 1 anything else,
with the cause. ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from volconv.device import NoDeviceError, list_devices, missing_platform_help, select_device

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Banks of 3D/4D convolution filters on OpenCL, exactly scipy.ndimage.convolve.",
)
console = Console()
err = Console(stderr=True)


class UserError(Exception):
    """A mistake of the user's: exit status 2 and one line naming the file, key or value."""


_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks.")) -> None:
    _state["debug"] = debug


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@app.command()
def devices() -> None:
    """Every OpenCL platform and device with its theoretical FP32 peak."""
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
        console.print(f"[bold]{d.spec}  {d.name}[/bold]  [{d.kind}]{chosen}", highlight=False)
        console.print(f"      platform   {d.platform} (driver {d.driver})", highlight=False)
        console.print(f"      compute    {d.compute_units} units at {d.clock_mhz} MHz")
        console.print(
            f"      memory     {_gib(d.global_mem)} global, {_gib(d.max_alloc)} max allocation, "
            f"{d.local_mem // 1024} KiB local"
        )
        console.print(f"      FP32 peak  {d.peak}  ({d.peak.how})", highlight=False)


@app.command()
def filters() -> None:
    """The filter types of [[bank.filter]] tables, their keys and defaults."""
    from volconv.bank import describe_types

    console.print(describe_types(), highlight=False, markup=False, soft_wrap=True)


# -- run and validate: volconv.pipeline does the work ------------------------------------
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


@app.command()
def run(
    pipeline: str = _PIPELINE,
    set_: list[str] | None = _SET,
    overwrite: bool = _OVERWRITE,
    device: str | None = _DEVICE,
    report: str | None = typer.Option(
        None, "--report", metavar="FILE", help="Also write the summary table as JSON to FILE."
    ),
) -> None:
    """Filter every input of the pipeline into its HDF5 file; print throughput per stage."""
    from rich.markup import escape

    from volconv import pipeline as pl

    try:
        cfg = pl.load(pipeline, set_ or (), device=device)
        pl.run_and_report(cfg, console, overwrite=overwrite, report=report)
    except pl.USER_ERRORS as e:  # the pipeline's, bank's, inputs' and writer's: exit 2
        raise UserError(escape(str(e))) from e  # main() prints markup: keep [input] as text


@app.command()
def validate(
    pipeline: str = _PIPELINE,
    set_: list[str] | None = _SET,
    overwrite: bool = _OVERWRITE,
    device: str | None = _DEVICE,
) -> None:
    """Check the pipeline, its bank and every input without computing; print the plan."""
    from rich.markup import escape

    from volconv import pipeline as pl

    try:
        pl.show_plan(pl.load(pipeline, set_ or (), device=device), console, overwrite=overwrite)
    except pl.USER_ERRORS as e:
        raise UserError(escape(str(e))) from e


def main() -> None:
    """Entry point: map exceptions to the exit statuses SPEC.md promises."""
    try:
        app()  # typer reports bad options itself (exit 2) and exits through SystemExit
    except UserError as e:
        if _state["debug"]:
            raise
        err.print(f"[red]error:[/red] {e}", highlight=False)
        sys.exit(2)
    except NoDeviceError as e:
        if _state["debug"]:
            raise
        err.print(f"[red]error:[/red] {e}", highlight=False)
        sys.exit(1)
    except Exception as e:  # the cause, in one line; --debug for the traceback
        if _state["debug"]:
            raise
        err.print(f"[red]error:[/red] {type(e).__name__}: {e}", highlight=False)
        sys.exit(1)
