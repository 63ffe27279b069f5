"""`volconv show OUTPUT`: a PNG of the central slices of every output, the first look a user
wants after a run, in any format volconv writes (HDF5, NIfTI, OME-Zarr: `volconv.output.read`).

Each filter gets three orthogonal central slices side by side, titled with its name and value
range; the filters run down in rows and wrap into as many groups across as keep the picture
about square, and the picture stays within `MAX_PIXELS` a side (the panels shrink). Slices
keep the voxel size's aspect (the output's ``voxel_size``); a 4D output shows one frame
(the middle one unless asked), named in the title. uint8 outputs are shown as the values
they stand for (``stored * scale + offset``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from volconv.output.stored import Stored

MAX_PIXELS = 2400  # the most pixels a side of the picture
DPI = 80
PANEL_INCHES = 2.3  # a slice's side, where the cap allows


def central_slices(stored: Stored, index: int, frame: int = 0) -> list[np.ndarray]:
    """The planes through the centre of output ``index`` (frame ``frame`` of a 4D output),
    across x, y and z, as float32 values (uint8 decoded with its scale and offset)."""
    values = stored.outputs[index]
    nx, ny, nz = values.shape[:3]
    t = (frame,) if len(values.shape) == 4 else ()
    planes = [
        values[(nx // 2, slice(None), slice(None), *t)],
        values[(slice(None), ny // 2, slice(None), *t)],
        values[(slice(None), slice(None), nz // 2, *t)],
    ]
    return [stored.decode(p) for p in planes]


def slice_aspects(voxel_size: object) -> tuple[float, float, float]:
    """imshow's aspect (a pixel's height over its width) of the x, y and z central slices as
    drawn (``plane.T``: the later axis upwards): vz/vy, vz/vx, vy/vx; 1 where the voxel size
    is missing or not positive."""
    try:
        v = [float(s) for s in np.asarray(voxel_size, np.float64).ravel()[:3]]
    except (TypeError, ValueError):
        v = []
    if len(v) < 3 or not all(math.isfinite(s) and s > 0 for s in v):
        return 1.0, 1.0, 1.0
    vx, vy, vz = v
    return vz / vy, vz / vx, vy / vx


def grid(n: int) -> tuple[int, int]:
    """(rows, groups across) for ``n`` filters of three slices each: about square."""
    groups = max(1, math.ceil(math.sqrt(n / 3)))
    return math.ceil(n / groups), groups


def figure(stored: Stored, name: str, frame: int | None = None) -> Figure:
    """The picture of the open output ``stored`` (``name`` for its title)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    names = stored.names
    four_d = bool(stored.outputs) and len(stored.outputs[0].shape) == 4
    n_frames = stored.outputs[0].shape[3] if four_d else 1
    if frame is None:
        frame = n_frames // 2
    elif not four_d:
        raise ValueError(f"--frame {frame}: {name} is 3D (no frames)")
    elif not 0 <= frame < n_frames:
        raise ValueError(f"--frame {frame}: {name} has {n_frames} frames (0..{n_frames - 1})")
    aspects = slice_aspects(stored.voxel_size)
    rows, groups = grid(len(names))
    # inches: above the grid (the title), above each row (a filter's title), below (labels)
    top, above, below, gap = 0.6, 0.3, 0.2, 0.08
    most = MAX_PIXELS / DPI  # panels shrink so that the picture stays within it a side
    side = min(PANEL_INCHES, most / (3 * groups) - gap, (most - top) / rows - above - below)
    width = 3 * groups * (side + gap)
    height = top + rows * (side + above + below)
    fig, axes = plt.subplots(
        rows, 3 * groups, squeeze=False, figsize=(width, height), dpi=DPI,
        gridspec_kw={"left": gap / 2 / width, "right": 1 - gap / 2 / width,
                     "top": 1 - (top + above) / height, "bottom": below / height,
                     "wspace": gap / side, "hspace": (above + below) / side},
    )  # fmt: skip
    for ax in axes.ravel():
        ax.set_axis_off()
    for i, filt in enumerate(names):
        row, group = i % rows, i // rows
        planes = central_slices(stored, i, frame if four_d else 0)
        finite = np.concatenate([p[np.isfinite(p)] for p in planes])
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        trio = axes[row][3 * group : 3 * group + 3]
        for ax, plane, axis, aspect in zip(trio, planes, "xyz", aspects, strict=True):
            ax.set_axis_on()
            ax.imshow(plane.T, origin="lower", cmap="gray", vmin=lo, vmax=hi, aspect=aspect)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_xlabel(f"{axis} = centre", fontsize=6)
        trio[1].set_title(f"{filt}: {lo:.4g} .. {hi:.4g}", fontsize=8)
    source = stored.attrs.get("source", "")
    when = f", frame {frame} of {n_frames}" if four_d else ""
    fig.suptitle(f"{name} ({source}){when}", fontsize=10, y=1 - 0.1 / height, va="top")
    return fig


def _is_png(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == b"\x89PNG\r\n\x1a\n"
    except OSError:
        return False


def show(output: str | Path, png: str | Path | None = None, frame: int | None = None) -> Path:
    """Draw the central slices of every response of ``output`` into ``png`` (default: the
    output's name with ``.png``; in a folder ``png``, that name there) and return its path.
    ``frame``: which frame of a 4D output (default the middle one)."""
    import matplotlib.pyplot as plt

    output = Path(output)
    png = Path(png) if png else output.with_suffix(".png")
    if png.is_dir():  # a folder: the picture goes in it, named after the output
        png = png / output.with_suffix(".png").name
    if png.suffix.lower() not in (".png", ""):
        raise ValueError(f"--png {png}: give a name ending in .png")
    if png.exists() and not _is_png(png):  # never write over anything but an earlier picture
        raise ValueError(f"--png {png}: exists and is not a PNG; give another name")
    from volconv.output import read

    with read(output) as stored:  # an OutputError (not complete, hdf5plugin missing) says why
        fig = figure(stored, output.name, frame)
        fig.savefig(png, dpi=DPI, format="png")
        plt.close(fig)
    return png
