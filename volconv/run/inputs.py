"""The read stage: the pipeline's paths and globs turned into inputs (`expand_inputs`), each
opened lazily (`open_volume`) into a `volconv.run.volume.Volume` that reads a slab of rows at a
time.

`open_volume` understands everything nibabel loads (NIfTI-1/2, MINC, Analyze, MGH) and ``.npy``
files (`volconv.run.readers`), and HDF5 datasets named ``file.h5:/dataset``
(`volconv.run.read_hdf5`, which reads no other file unless allowed).
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

from volconv.checks import file_kind
from volconv.run.read_hdf5 import open_hdf5
from volconv.run.readers import open_nibabel, open_npy, open_plain_nifti
from volconv.run.volume import InputError, Volume, reading

# "file.h5:/group/data" -> ("file.h5", "/group/data"); the suffix keeps Windows drives and
# colons in folder names out of it.
_HDF5_SPEC = re.compile(r"^(?P<file>.+\.(?:h5|hdf5)):(?P<dataset>.*)$", re.IGNORECASE)
_GLOB = re.compile(r"[*?\[]")


def split_spec(spec: str | Path) -> tuple[str, str | None]:
    """``"f.h5:/ds"`` -> ``("f.h5", "/ds")``; any other input -> ``(spec, None)``."""
    m = _HDF5_SPEC.match(str(spec))
    if m is None:
        return str(spec), None
    dataset = m["dataset"].strip()
    return m["file"], ("/" + dataset.lstrip("/")) if dataset else None


def open_volume(spec: str | Path, *, external: bool = False) -> Volume:
    """Open an input volume without reading its voxels.

    Parameters
    ----------
    spec : str or Path
        A file nibabel loads (NIfTI-1/2 ``.nii``/``.nii.gz``, MINC, Analyze, MGH), a ``.npy``
        file, or an HDF5 dataset as ``file.h5:/dataset`` (or ``.hdf5``). 4D inputs hold T
        volumes along their last axis; trailing axes of length 1 beyond the fourth are
        dropped.
    external : bool
        Allow an HDF5 dataset that reads other files: a virtual dataset, external storage,
        or one reached through an external link (``[input] external``). Refused otherwise.

    Raises
    ------
    InputError
        The file is missing, a folder, unreadable or truncated (see `check_data`), or the
        volume is not a non-empty 3D/4D array of integers or floats (bool and complex are
        refused); for HDF5, also a missing dataset (the message lists the datasets the file
        holds); for a 4D MINC file, dimensions other than three spatial ones and time; an
        HDF5 dataset that reads other files, unless ``external`` (and then, a virtual
        dataset whose source file or dataset is missing).
    """
    path = str(spec)
    name, dataset = split_spec(path)
    file = Path(name)
    if file.is_dir():
        raise InputError(f"{name}: is a folder, not a volume file")
    if not file.exists():
        raise InputError(f"{name}: no such file")
    if not file.is_file():  # a FIFO, a device: no volume file, and opening one may block
        raise InputError(f"{name}: is {file_kind(file)}, not a volume file")
    with reading(path):
        if dataset is not None or file.suffix.lower() in (".h5", ".hdf5"):
            return open_hdf5(path, file, dataset, external)
        if file.suffix.lower() == ".npy":
            return open_npy(path, file)
        if file.suffix.lower() == ".nii" and (volume := open_plain_nifti(path, file)):
            return volume
        return open_nibabel(path, file)


def expand_inputs(patterns: list[str], base_dir: Path) -> list[str]:
    """Input files named by paths and globs, sorted and without duplicates.

    Parameters
    ----------
    patterns : list of str
        Files or globs (``*``, ``?``, ``[...]``, ``**``), relative to ``base_dir`` unless
        absolute; a name that is a file is that file, whatever its characters; an HDF5
        dataset suffix (``"scans/*.h5:/data"``) is kept on every match.
    base_dir : Path
        The folder relative paths start from (the pipeline file's folder).

    Raises
    ------
    InputError
        A pattern matches no file, or names a folder.
    """
    found: set[str] = set()
    for pattern in patterns:
        name, dataset = split_spec(pattern)
        full = os.path.join(base_dir, os.path.expanduser(name))
        if os.path.isfile(full):  # a file is itself, even named "[x].npy"
            matches = [full]
        elif _GLOB.search(name):
            matches = [m for m in glob.glob(full, recursive=True) if os.path.isfile(m)]
        else:
            matches = []
        if not matches:
            if os.path.exists(full):  # a folder, a FIFO, a device
                kind = file_kind(full)
                raise InputError(f"{pattern}: is {kind}, not a volume file (in {base_dir})")
            what = "matches no file" if _GLOB.search(name) else "no such file"
            raise InputError(f"{pattern}: {what} (looked in {base_dir})")
        suffix = f":{dataset}" if dataset else ""
        found.update(os.path.normpath(m) + suffix for m in matches)
    return sorted(found)
