"""`volconv show OUTPUT.h5`: a PNG of the central slices of every response, the first look a
user wants after a run.

One row per filter (three orthogonal central slices of the first frame), titled with the
filter's name and its value range; uint8 outputs are shown as the values they stand for
(``stored * scale + offset``).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np


def central_slices(responses: h5py.Dataset, index: int) -> list[np.ndarray]:
    """The planes through the centre of response ``index`` (first frame of a 4D output),
    across x, y and z, as float32 values (uint8 decoded with its scale and offset)."""
    nx, ny, nz = responses.shape[1:4]
    frame = (0,) if responses.ndim == 5 else ()
    planes = [
        responses[(index, nx // 2, slice(None), slice(None), *frame)],
        responses[(index, slice(None), ny // 2, slice(None), *frame)],
        responses[(index, slice(None), slice(None), nz // 2, *frame)],
    ]
    scale = float(responses.attrs.get("scale", 1.0))
    offset = float(responses.attrs.get("offset", 0.0))
    return [p.astype(np.float32) * np.float32(scale) + np.float32(offset) for p in planes]


def _is_png(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == b"\x89PNG\r\n\x1a\n"
    except OSError:
        return False


def show(output: str | Path, png: str | Path | None = None) -> Path:
    """Draw the central slices of every response of ``output`` into ``png`` (default: the
    output's name with ``.png``; in a folder ``png``, that name there) and return its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    output = Path(output)
    png = Path(png) if png else output.with_suffix(".png")
    if png.is_dir():  # a folder: the picture goes in it, named after the output
        png = png / output.with_suffix(".png").name
    if png.suffix.lower() not in (".png", ""):
        raise ValueError(f"--png {png}: give a name ending in .png")
    if png.exists() and not _is_png(png):  # never write over anything but an earlier picture
        raise ValueError(f"--png {png}: exists and is not a PNG; give another name")
    with h5py.File(output, "r") as f:
        if "responses" not in f or not f.attrs.get("complete", False):
            raise ValueError(f"{output}: not a complete volconv output")
        responses = f["responses"]
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in f["filter"][()]]
        n = len(names)
        fig, axes = plt.subplots(n, 3, figsize=(7.5, 2.3 * n + 0.6), squeeze=False)
        for i, name in enumerate(names):
            planes = central_slices(responses, i)
            finite = np.concatenate([p[np.isfinite(p)] for p in planes])
            lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
            for ax, plane, axis in zip(axes[i], planes, "xyz", strict=True):
                ax.imshow(plane.T, origin="lower", cmap="gray", vmin=lo, vmax=hi)
                ax.set_xticks([])
                ax.set_yticks([])
                ax.set_xlabel(f"{axis} = centre", fontsize=7)
            axes[i][0].set_title(f"{name}: {lo:.4g} .. {hi:.4g}", loc="left", fontsize=9)
        source = f.attrs.get("source", "")
        fig.suptitle(f"{output.name} ({source})", fontsize=10)
        height = fig.get_size_inches()[1]
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / height))  # room for the title above
        fig.savefig(png, dpi=80, format="png")
        plt.close(fig)
    return png
