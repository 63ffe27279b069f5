"""Pipeline files: TOML plus ``--set`` -> one validated `Config` (docs/contract.md,
"Pipeline file").

Everything a user can get wrong in a pipeline file is checked here, in `validate_config`, with a
message that names the file, the key and the value; `volconv.bank.filters` checks each filter
itself.
Nothing here opens an input or an OpenCL device: that is planning (`volconv.run.jobs`).
"""

from __future__ import annotations

import os
import re
import string
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from volconv.bank.features import Feature, build_features
from volconv.bank.filters import Filter, build_bank
from volconv.bank.spec import UNITS, BankError, is_number
from volconv.checks import (
    check_mode,
    check_positive_int,
    closest,
    fits_float32,
    parse_bytes,
    suggest,
)
from volconv.output import COMPRESSIONS, DTYPES, OutputError, check_compression, format_of


class PipelineError(ValueError):
    """A mistake in a pipeline file or a ``--set``: the message names the file, key and value."""


# Every valid key of every section; `validate_config` suggests the closest for a typo.
SCHEMA: dict[str, tuple[str, ...]] = {
    "input": ("paths", "external"),
    "bank": ("size", "boundary", "cval", "units", "filter", "feature", "preset", "scales"),
    "output": ("path", "format", "dtype", "compression", "scale", "offset"),
    "run": ("device", "devices", "scheduler", "host_memory", "slab_depth"),
}
REQUIRED_SECTIONS = ("input", "bank")
DEFAULT_OUTPUT = "{stem}.volconv.h5"
DEFAULT_HOST_MEMORY = "2GiB"
TEMPLATE_FIELDS = ("stem", "parent", "pipeline")
# Keys whose values are paths: given with --set, a relative one is relative to the folder the
# user stands in (as on any command line), not to the pipeline file's.
_PATH_KEYS = {("input", "paths"), ("output", "path"), ("filter", "path")}


@dataclass(frozen=True)
class Config:
    """A validated pipeline: what the file (after ``--set``) asks for."""

    source: Path  # the pipeline file
    base_dir: Path  # relative paths resolve against it: the pipeline file's folder
    text: str  # the TOML text stored in every output (normalised where --set changed it)
    data: dict[str, Any]  # the parsed TOML after --set
    paths: tuple[str, ...]
    size: int | list[int]
    boundary: str
    cval: float
    units: str
    filters: tuple[dict[str, Any], ...]
    output: str  # template with {stem}, {parent} and {pipeline}
    dtype: str
    compression: str
    scale: (
        float  # 1.0 where scale_auto: each output's own is `volconv.engines.convert.output_scale`'s
    )
    offset: float
    device: str
    slab_depth: int | None
    host_memory: int  # bytes: the bound on this run's host memory per device
    bank: tuple[Filter, ...]  # built while validating, at a unit voxel size
    bank_in_mm: bool  # some filter's sigma is in mm: the bank depends on the voxel size
    device_from_cli: bool = False
    # batch (volconv.run.batch): "one", "all" or the device specs of one worker each; and the
    # address of an existing Dask scheduler ("" for none)
    devices: str | tuple[str, ...] = "one"
    scheduler: str = ""
    # [input] external: HDF5 inputs may read other files (VDS, external storage and links)
    external: bool = False
    # [output] scale = "auto": each uint8 output's scale and offset from the bank's bound
    scale_auto: bool = False
    format: str = "hdf5"  # [output] format: hdf5, nifti or zarr (default from the path)
    features: tuple[Feature, ...] = ()  # [[bank.feature]] and [bank] preset (volconv.bank.features)


# -- reading and --set --------------------------------------------------------------------
def load(
    path: str | Path,
    sets: Sequence[str] = (),
    *,
    device: str | None = None,
    devices: str | None = None,
    scheduler: str | None = None,
) -> Config:
    """Read, override (``--set``, ``--device``, ``--devices``, ``--scheduler``) and validate
    the pipeline file at ``path``."""
    path = Path(path)
    if not path.exists():
        raise PipelineError(f"pipeline file not found: {path}")
    if not path.is_file():
        raise PipelineError(f"pipeline file is not a file: {path}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # an editor's byte-order mark is not TOML
    except (OSError, UnicodeDecodeError) as e:
        raise PipelineError(f"{path}: cannot read the pipeline file ({e})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PipelineError(f"{path}: not valid TOML: {e}") from None
    if sets:
        for item in sets:
            keys, value = parse_set(item)
            _apply_set(data, keys, value, item)
        text = f"# {path.name} with --set {' --set '.join(sets)}\n" + dump_toml(data)
    cfg = validate_config(data, path, text)
    if device is not None:  # --device outranks [run] device; the stored text keeps the file's
        cfg = replace(cfg, device=device.strip(), device_from_cli=True)
    if devices is not None:
        cfg = replace(cfg, devices=parse_devices(devices, "--devices", PipelineError))
    if scheduler is not None:
        cfg = replace(cfg, scheduler=scheduler.strip())
    if cfg.scheduler and cfg.devices != "one":
        raise PipelineError(
            f"{path}: devices = {cfg.devices!r} and scheduler = {cfg.scheduler!r}: the workers "
            "of a scheduler own their devices; give one or the other"
        )
    return cfg


def parse_devices(
    value: Any, where: str, error: Callable[[str], Exception]
) -> str | tuple[str, ...]:
    """``run.devices`` or ``--devices``: "one", "all", or device specs as ``--device`` takes
    them, in a list or separated by commas (one worker each; a spec may repeat)."""
    if isinstance(value, str) and value.strip().lower() in ("one", "all"):
        return value.strip().lower()
    specs = value.split(",") if isinstance(value, str) else value
    if (
        not isinstance(specs, list | tuple)
        or not specs
        or not all(isinstance(s, str) and s.strip() for s in specs)
    ):
        raise error(
            f"{where} must be one, all, or device specs (as --device takes them) in a list or "
            f'separated by commas, e.g. "0:0,0:1"; got {value!r}'
        )
    return tuple(s.strip() for s in specs)


_SET_KEY = re.compile(r"^[A-Za-z0-9_-]+(\[\d+\])?$")


def parse_set(item: str) -> tuple[list[str | int], Any]:
    """``section.key=value`` -> (key path, value); ``bank.filter[2].sigma`` indexes a filter.

    The value is read as a TOML value (``3``, ``1.5``, ``[1, 2, 3]``, ``"text"``, ``true``),
    else taken as the string it is (``--set input.paths=scan.nii.gz``). Relative paths given
    for ``input.paths``, ``output.path`` and a filter's ``path`` are made absolute against the
    working directory, as any path typed on a command line.
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or len(parts) < 2 or not all(_SET_KEY.match(p) for p in parts):
        raise PipelineError(
            f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. --set bank.boundary=nearest"
        )
    path: list[str | int] = []
    for p in parts:
        name, _, index = p.partition("[")
        path.append(name)
        if index:
            path.append(int(index[:-1]))
    value = parse_value(raw.strip())
    names = [k for k in path if isinstance(k, str)]
    if tuple(names[-2:]) in _PATH_KEYS:
        value = _from_cwd(value)
    return path, value


def _from_cwd(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_cwd(v) for v in value]
    if isinstance(value, str) and value.strip():
        p = Path(value).expanduser()
        return str(p if p.is_absolute() else Path.cwd() / p)
    return value


def parse_value(raw: str) -> Any:
    """A TOML value, else the string itself."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _apply_set(data: dict[str, Any], keys: list[str | int], value: Any, item: str) -> None:
    node: Any = data
    for i, k in enumerate(keys[:-1]):
        where = _dotted(keys[: i + 1])
        if isinstance(k, int):
            if not isinstance(node, list) or not 0 <= k < len(node):
                size = len(node) if isinstance(node, list) else 0
                raise PipelineError(f"--set {item!r}: {where} does not exist ({size} entries)")
            node = node[k]
        else:
            if not isinstance(node, dict):
                raise PipelineError(f"--set {item!r}: {_dotted(keys[:i])} is not a table")
            node = node.setdefault(k, {})
    last = keys[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or not 0 <= last < len(node):
            raise PipelineError(f"--set {item!r}: {_dotted(keys)} does not exist")
        node[last] = value
    elif not isinstance(node, dict):
        raise PipelineError(f"--set {item!r}: {_dotted(keys[:-1])} is not a table")
    else:
        node[last] = value


def _dotted(keys: Iterable[str | int]) -> str:
    out = ""
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
    return out


def dump_toml(data: dict[str, Any]) -> str:
    """TOML text that `tomllib` reads back as ``data``."""
    import tomli_w  # for the files volconv writes, not for a run

    return tomli_w.dumps(data)


# -- validation: the one place ------------------------------------------------------------
def validate_config(data: dict[str, Any], source: Path, text: str = "") -> Config:
    """Check every section and key of a parsed pipeline; `PipelineError` names what is wrong."""

    def fail(msg: str) -> PipelineError:
        return PipelineError(f"{source}: {msg}")

    for section, body in data.items():
        if section not in SCHEMA:
            near = closest(section, SCHEMA)
            hint = f"did you mean [{near}]?" if near else f"valid: {', '.join(SCHEMA)}"
            raise fail(f"unknown section [{section}] ({hint})")
        if not isinstance(body, dict):
            raise fail(f"{section} must be a table [{section}]; got {body!r}")
        for key in body:
            if key not in SCHEMA[section]:
                hint = suggest(key, SCHEMA[section], f"{section}.")
                raise fail(f"unknown key {section}.{key} ({hint})")
    for section in REQUIRED_SECTIONS:
        if section not in data:
            raise fail(f"missing section [{section}]")
    inp, bank = data["input"], data["bank"]
    out, run = data.get("output", {}), data.get("run", {})

    # [input]
    if "paths" not in inp:
        raise fail('input.paths is missing: give files or globs, e.g. paths = ["scans/*.nii.gz"]')
    paths = inp["paths"]
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list) or not all(isinstance(p, str) and p.strip() for p in paths):
        raise fail(f"input.paths must be a path or a list of paths; got {inp['paths']!r}")
    if not paths:
        raise fail("input.paths is empty")
    external = inp.get("external", False)
    if not isinstance(external, bool):
        raise fail(
            f"input.external must be true or false (whether an HDF5 input may read other "
            f"files: a virtual dataset, external storage or links); got {external!r}"
        )

    # [bank]; each filter is checked by volconv.bank.filters.build_bank
    size = bank.get("size", 7)  # checked by build_bank, with the filters
    try:
        boundary = check_mode(bank.get("boundary", "reflect"), "bank.boundary")
    except ValueError as e:
        raise fail(str(e)) from None
    cval = bank.get("cval", 0.0)
    if not is_number(cval):
        raise fail(f"bank.cval must be a finite number; got {cval!r}")
    if not fits_float32(cval):
        raise fail(f"bank.cval must be within float32's range (|cval| <= 3.4e38); got {cval!r}")
    units = bank.get("units", "voxels")
    if units not in UNITS:
        raise fail(f"bank.units = {units!r} is not one of {', '.join(UNITS)}")
    filters = bank.get("filter", [])
    if not isinstance(filters, list) or not all(isinstance(f, dict) for f in filters):
        raise fail("bank.filter must be an array of tables: [[bank.filter]]")
    try:
        features = build_features(bank.get("feature"), size=size, units=units,
                                  preset=bank.get("preset"), scales=bank.get("scales"))  # fmt: skip
    except BankError as e:
        raise fail(str(e)) from None
    if not filters and not features:
        raise fail("bank.filter: the bank is empty; add at least one [[bank.filter]] table")
    try:  # every filter, at unit voxel size (inputs in mm are built again by plan_jobs)
        bank = build_bank([dict(f) for f in filters], size, base_dir=source.resolve().parent,
                          units=units) if filters else []  # fmt: skip
    except BankError as e:
        raise fail(str(e)) from None
    in_mm = units == "mm" or any(f.get("units") == "mm" for f in filters)

    # [output]
    template = out.get("path", DEFAULT_OUTPUT)
    if not isinstance(template, str) or not template.strip():
        raise fail(f"output.path must be a file path; got {template!r}")
    _check_template(template, fail)
    dtype = out.get("dtype", "float32")
    if dtype not in DTYPES:
        raise fail(f"output.dtype = {dtype!r} is not one of {', '.join(DTYPES)}")
    compression = out.get("compression", "none")
    if not isinstance(compression, str):
        raise fail(f"output.compression must be one of {', '.join(COMPRESSIONS)}; "
                   f"got {compression!r}")  # fmt: skip
    try:
        fmt = format_of(template, out.get("format"))
    except OutputError as e:
        raise fail(f"output.{'format' if 'format' in out else 'path'}: {e}") from None
    try:
        check_compression(fmt, compression)
    except OutputError as e:
        raise fail(f"output.compression: {e}") from None
    if fmt == "nifti" and dtype == "float16":
        raise fail('output.dtype = "float16": NIfTI stores float32 or uint8; set output.dtype '
                   "or write HDF5 or OME-Zarr")  # fmt: skip
    scale_auto = out.get("scale") == "auto"
    if scale_auto and (data["bank"].get("feature") or data["bank"].get("preset")):
        raise fail('output.scale = "auto" bounds filter responses only; with bank.feature or '
                   "bank.preset give output.scale and output.offset")  # fmt: skip
    if scale_auto and "offset" in out:
        raise fail('output.scale = "auto" chooses the offset too; remove output.offset')
    for key in ("scale", "offset"):
        if key in out:
            v = out[key]
            if dtype != "uint8":
                raise fail(f'output.{key} applies to dtype = "uint8" only (dtype is {dtype!r})')
            if scale_auto:
                continue
            if not is_number(v) or (key == "scale" and v == 0):
                what = ('a finite non-zero number or "auto"' if key == "scale"
                        else "a finite number")  # fmt: skip
                raise fail(f"output.{key} must be {what}; got {v!r}")
            # quantised in float32: a scale that rounds to 0 or a subnormal divides into inf
            tiny = key == "scale" and abs(v) < float(np.finfo(np.float32).tiny)
            if tiny or not fits_float32(v):
                raise fail(f"output.{key} must be within float32's range "
                           f"({'1.2e-38 <= |scale|' if key == 'scale' else '|offset|'} <= 3.4e38); "
                           f"got {v!r}")  # fmt: skip

    # [run]
    device = run.get("device", "auto")
    if not isinstance(device, str) or not device.strip():
        raise fail(f"run.device must be auto, gpu, cpu, a name fragment or 'p:d'; got {device!r}")
    try:
        host_memory = parse_bytes(run.get("host_memory", DEFAULT_HOST_MEMORY), "run.host_memory")
    except ValueError as e:
        raise fail(str(e)) from None
    host_memory = min(host_memory, machine_memory())  # "1PiB": all this machine has
    slab_depth = run.get("slab_depth")
    if slab_depth is not None:
        try:
            check_positive_int(slab_depth, "run.slab_depth")
        except ValueError as e:
            raise fail(str(e)) from None
    devices = parse_devices(run.get("devices", "one"), "run.devices", fail)
    scheduler = run.get("scheduler", "")
    if not isinstance(scheduler, str):
        raise fail(f"run.scheduler must be an address such as tcp://host:8786; got {scheduler!r}")

    return Config(
        source=source, base_dir=source.resolve().parent, text=text or dump_toml(data),
        data=data, paths=tuple(paths), size=size, boundary=boundary, cval=float(cval),
        units=units, filters=tuple(filters), output=template, dtype=dtype,
        compression=compression, scale=1.0 if scale_auto else float(out.get("scale", 1.0)),
        offset=float(out.get("offset", 0.0)), external=external, scale_auto=scale_auto,
        device=device.strip(), slab_depth=slab_depth,
        host_memory=host_memory, bank=tuple(bank), bank_in_mm=in_mm, devices=devices,
        scheduler=scheduler.strip(), format=fmt, features=tuple(features),
    )  # fmt: skip


def machine_memory() -> int:
    """The bytes of memory this machine has (physical pages); a huge number where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**62


def _check_template(template: str, fail: Callable[[str], PipelineError]) -> None:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise fail(f"output.path = {template!r}: {e} (write {{{{ and }}}} for braces)") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in TEMPLATE_FIELDS or spec or conversion:
            raise fail(
                f"output.path = {template!r}: unknown field {{{name}}}; use {{stem}} (input "
                "file name without extensions), {parent} (its folder) or {pipeline} (the "
                "pipeline file's name without .toml)"
            )
