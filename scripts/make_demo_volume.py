"""Make the demo scan: the MNI152 T1 template that nilearn ships, as uint8 256^3 NIfTI.

The ICBM 2009a nonlinear symmetric T1 template (1 mm, 197 x 233 x 189) is inside nilearn's
wheel (``pip install -e ".[demo]"``), so nothing is downloaded at run time. It is padded with
background (0) to 256^3, centred, with the affine shifted so every voxel keeps its world
position, rescaled to 0..255 uint8 where it is not uint8 already, and written uncompressed so
that volconv reads it slab by slab through a memory map.

    python scripts/make_demo_volume.py [--out data/mni152_t1_256.nii] [--size 256]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import nibabel as nib
import numpy as np

TEMPLATE = "datasets/data/mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz"
ROOT = Path(__file__).resolve().parent.parent


def template_path() -> Path:
    """The template inside the installed nilearn, found without importing nilearn."""
    spec = importlib.util.find_spec("nilearn")
    if spec is None or not spec.submodule_search_locations:
        sys.exit('make_demo_volume: nilearn is not installed; pip install -e ".[demo]"')
    path = Path(next(iter(spec.submodule_search_locations))) / TEMPLATE
    if not path.is_file():
        sys.exit(f"make_demo_volume: this nilearn has no {TEMPLATE}")
    return path


def to_uint8(data: np.ndarray) -> np.ndarray:
    """0..255: as it is for uint8 data, else the range 0..99.9th percentile scaled."""
    if data.dtype == np.uint8:
        return data
    data = np.asarray(data, np.float64)
    lo, hi = 0.0, float(np.percentile(data, 99.9))
    return np.clip(np.rint((data - lo) / (hi - lo) * 255), 0, 255).astype(np.uint8)


def pad_to(data: np.ndarray, affine: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``data`` centred in a ``size``^3 array of zeros (cropped centrally if larger)."""
    out = np.zeros((size,) * 3, data.dtype)
    src, dst, shift = [], [], np.zeros(3)
    for n in data.shape:
        before = (size - n) // 2
        if before >= 0:
            src.append(slice(0, n))
            dst.append(slice(before, before + n))
        else:
            src.append(slice(-before, -before + size))
            dst.append(slice(0, size))
        shift[len(src) - 1] = before
    out[tuple(dst)] = data[tuple(src)]
    # voxel i of the output is voxel i - before of the input
    move = np.eye(4)
    move[:3, 3] = -shift
    return out, affine @ move


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "mni152_t1_256.nii")
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()

    img = nib.load(template_path())
    data = to_uint8(np.asanyarray(img.dataobj))
    data, affine = pad_to(data, img.affine, args.size)
    out = nib.Nifti1Image(data, affine)
    out.header.set_xyzt_units("mm")
    out.header.set_data_dtype(np.uint8)
    out.header["descrip"] = b"MNI152 ICBM 2009a sym T1 (nilearn), uint8, padded"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    nib.save(out, args.out)
    print(f"{args.out}: {'x'.join(map(str, data.shape))} uint8 (from {img.shape}, 1 mm)")


if __name__ == "__main__":
    main()
