"""Where an input lies in the world, as every output format records it: the affine, NIfTI's
sform and qform with their codes, the units of space and time, and a 4D scan's repetition
time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from volconv.run.volume import Volume

# NIfTI's unit codes (xyzt_units) and what one unit is in mm or seconds.
SPACE_UNITS = {"meter": 1000.0, "mm": 1.0, "micron": 1e-3}
TIME_UNITS = {"sec": 1.0, "msec": 1e-3, "usec": 1e-6}
# NGFF's names of the units
NGFF_UNITS = {"meter": "meter", "mm": "millimeter", "micron": "micrometer"}


@dataclass(frozen=True, eq=False)
class Space:
    """Voxel to world, and the units, of one input.

    Attributes
    ----------
    affine : (4, 4) array
        Voxel (x, y, z) to world, as `volconv.run.volume.Volume.affine`.
    voxel_size : tuple of float
        The affine's column norms (or the header's zooms), in `space_unit`.
    sform, qform : (4, 4) arrays, and their codes
        As a NIfTI input's header holds them; otherwise the affine, sform code 2 (aligned)
        and qform code 0, as nibabel writes an image made from an affine.
    space_unit, time_unit : str
        NIfTI's names (``mm``, ``sec``, ...); ``unknown`` where the header does not say.
    repetition_time : float or None
        Seconds between the frames of a 4D input, where its header gives it.
    """

    affine: np.ndarray
    voxel_size: tuple[float, float, float]
    sform: np.ndarray
    sform_code: int = 2
    qform: np.ndarray | None = None
    qform_code: int = 0
    space_unit: str = "mm"
    time_unit: str = "unknown"
    repetition_time: float | None = None

    @classmethod
    def from_affine(cls, affine: np.ndarray, voxel_size: object = None) -> Space:
        affine = np.asarray(affine, np.float64)
        if voxel_size is None:
            voxel_size = np.sqrt(np.sum(affine[:3, :3] ** 2, axis=0))
        return cls(affine, tuple(float(v) for v in voxel_size), affine, 2, affine, 0)

    @classmethod
    def of(cls, volume: Volume) -> Space:
        """The space of ``volume``: from its NIfTI header where it has one (codes, units,
        repetition time), else from its affine."""
        space = cls.from_affine(volume.affine, volume.voxel_size)
        header = getattr(volume, "nifti_header", None) or _nifti_header(volume.file)
        if header is None:
            return space
        sform, scode = header.get_sform(coded=True)
        qform, qcode = header.get_qform(coded=True)
        xyz, t = header.get_xyzt_units()
        tr = None
        zooms = header.get_zooms()
        if len(volume.shape) == 4 and len(zooms) > 3 and zooms[3] > 0 and t in TIME_UNITS:
            tr = float(zooms[3]) * TIME_UNITS[t]
        return cls(
            space.affine,
            space.voxel_size,
            space.affine if sform is None else np.asarray(sform, np.float64),
            int(scode),
            None if qform is None else np.asarray(qform, np.float64),
            int(qcode),
            xyz if xyz in SPACE_UNITS else "unknown",
            t if t in TIME_UNITS else "unknown",
            tr,
        )

    @property
    def unit_mm(self) -> float:
        """One space unit in mm (1 where the header does not say: NIfTI's convention)."""
        return SPACE_UNITS.get(self.space_unit, 1.0)

    def axes(self) -> tuple[np.ndarray, np.ndarray]:
        """Origin and step in mm of the x, y, z axes: exact world coordinates where the
        affine is diagonal (no rotation; a flip gives a negative step), else the voxel size
        and the affine's translation (the full affine is kept beside)."""
        linear = self.affine[:3, :3]
        if np.count_nonzero(linear - np.diag(np.diag(linear))) == 0:
            step = np.diag(linear).copy()
        else:
            step = np.asarray(self.voxel_size, np.float64)
        return self.affine[:3, 3] * self.unit_mm, step * self.unit_mm

    def coordinates(self, shape: tuple[int, ...]) -> list[np.ndarray]:
        """World coordinates (mm) of every voxel along x, y, z (`axes`), and the frames'
        times in seconds where the repetition time is known (else frame indices)."""
        origin, step = self.axes()
        coords = [origin[i] + step[i] * np.arange(shape[i], dtype=np.float64) for i in range(3)]
        if len(shape) == 4:
            tr = self.repetition_time or 1.0
            coords.append(tr * np.arange(shape[3], dtype=np.float64))
        return coords


def _nifti_header(file: Path):
    """The NIfTI-1/2 header of ``file`` (only the header is read), or None for another kind."""
    name = Path(file).name.lower()
    if not name.endswith((".nii", ".nii.gz", ".hdr", ".img", ".img.gz")):
        return None
    import nibabel as nib

    try:
        header = nib.load(file).header
    except Exception:  # not a NIfTI after all: the affine alone
        return None
    needed = ("get_sform", "get_qform", "get_xyzt_units")
    return header if all(hasattr(header, k) for k in needed) else None
