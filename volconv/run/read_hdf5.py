"""The reader of HDF5 datasets named ``file.h5:/dataset``, and its rule on other files.

An HDF5 dataset can read other files: a virtual dataset (VDS) maps other files' datasets,
external storage keeps its bytes in raw files, an external link reaches into another HDF5
file. None of these is opened unless the user allows it (``[input] external = true``,
``external=True`` here); where allowed, every file a VDS maps must be there (HDF5 itself
would read a missing one as fill values), and the input's SHA-256 covers the data read, not
only the container (`volconv.run.volume.Volume.sha256`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np

from volconv.run.volume import InputError, Volume, check_shape_type, make_volume, squeeze_tail


def open_hdf5(path: str, file: Path, dataset: str | None, external: bool = False) -> Volume:
    with h5py.File(file, "r") as f:
        linked = _links_out(f, dataset) if dataset else []
        if linked and not external:
            raise InputError(_refusal(path, "is reached through an external link to", linked))
        obj = f.get(dataset) if dataset else None
        if not isinstance(obj, h5py.Dataset):
            held = ", ".join(_datasets(f)) or "none"
            what = f"no dataset {dataset}" if dataset else "name a dataset as file.h5:/dataset"
            raise InputError(f"{path}: {what}; the file's datasets: {held}")
        if obj.shape is None:  # a null dataspace (h5py.Empty): no voxels at all
            raise InputError(f"{path}: the dataset is empty (a null dataspace, no voxels)")
        reads = _reads_other_files(path, file, obj, external)
        shape, extra = squeeze_tail(obj.shape)
        check_shape_type(path, shape, obj.dtype)
        dtype = obj.dtype
        given = "affine" in obj.attrs
        affine = obj.attrs["affine"] if given else np.eye(4)

    @contextmanager
    def opener() -> Iterator[h5py.Dataset]:
        with h5py.File(file, "r") as f:
            yield f[dataset]

    unknown = "" if given else "the HDF5 dataset has no affine attribute (no voxel size)"
    return make_volume(path, file, shape, dtype, affine, None, opener, extra,
                   voxel_unknown=unknown, digest_data=bool(linked or reads))  # fmt: skip


def _refusal(path: str, what: str, targets: list[str]) -> str:
    shown = ", ".join(targets[:3]) + (f" and {len(targets) - 3} more" if len(targets) > 3 else "")
    return (
        f"{path}: {what} {shown}: volconv reads no other file unless allowed "
        "(set input.external = true to allow it)"
    )


def _links_out(f: h5py.File, dataset: str) -> list[str]:
    """The external links on the way to ``dataset`` in ``f`` ("file:/path" each), found
    without following one: soft links are resolved here, by name, so that none leads out
    of the file unseen."""
    found: list[str] = []
    todo, done, steps = [p for p in dataset.split("/") if p], "", 0
    while todo:
        steps += 1
        if steps > 256:  # soft links in a loop: h5py says what it finds
            break
        name = f"{done}/{todo.pop(0)}"
        try:
            link = f.get(name, getlink=True)
        except (KeyError, OSError, ValueError):
            break  # missing: the open below names it
        if isinstance(link, h5py.ExternalLink):
            found.append(f"{link.filename}:{link.path}")
            break  # what lies beyond is in the other file
        if isinstance(link, h5py.SoftLink):
            target = link.path
            base = [] if target.startswith("/") else [p for p in done.split("/") if p]
            todo = base + [p for p in target.split("/") if p] + todo
            done = ""
        else:
            done = name
    return found


def _reads_other_files(
    path: str, file: Path, obj: h5py.Dataset, external: bool, depth: int = 0
) -> bool:
    """Refuse a dataset whose data lies in other files (a VDS of other files, external
    storage, a VDS source reached through an external link) unless ``external``; refuse a
    VDS whose source file or dataset is missing (HDF5 reads one as fill values), its
    sources' own sources too. Whether the dataset reads other files."""
    if depth > 8:
        raise InputError(f"{path}: virtual datasets map one another more than 8 deep")
    dcpl = obj.id.get_create_plist()
    stored = [dcpl.get_external(i)[0].decode(errors="replace")
              for i in range(dcpl.get_external_count())]  # fmt: skip
    if stored and not external:
        raise InputError(_refusal(path, "keeps its data in the external files", stored))
    for name in stored:  # HDF5 opens them from the working folder, as named
        if not Path(name).is_file():
            raise InputError(f"{path}: the external file {name} of its data is missing")
    if not obj.is_virtual:
        return bool(stored)
    sources = obj.virtual_sources()
    # a source in the file itself (".") reads nothing else, unless through a link
    others = [f"{s.file_name}:{s.dset_name}" for s in sources if s.file_name != "."]
    if others and not external:
        raise InputError(_refusal(path, "is a virtual dataset reading", others))
    reads = bool(stored or others)
    here = Path(obj.file.filename)
    for source in sources:
        found = _source_file(source.file_name, here)
        if found is None:
            raise InputError(
                f"{path}: the virtual dataset's source file {source.file_name} is missing "
                "(HDF5 would read it as fill values)"
            )
        try:
            with h5py.File(found, "r") as src:
                linked = _links_out(src, source.dset_name)
                if linked and not external:
                    raise InputError(_refusal(
                        path, "is a virtual dataset reading, through an external link,", linked
                    ))  # fmt: skip
                held = src.get(source.dset_name)
                ok = isinstance(held, h5py.Dataset)
                if ok:  # a source may itself be virtual, or stored elsewhere
                    reads |= _reads_other_files(path, found, held, external, depth + 1)
                reads |= bool(linked)
        except OSError as e:
            raise InputError(
                f"{path}: the virtual dataset's source file {source.file_name} cannot be "
                f"read ({' '.join(str(e).split())})"
            ) from None
        if not ok:
            raise InputError(
                f"{path}: the virtual dataset's source {source.file_name}:{source.dset_name} "
                "is missing (HDF5 would read it as fill values)"
            )
    return reads


def _source_file(name: str, vds: Path) -> Path | None:
    """Where HDF5 finds a VDS source file: ``.`` is the VDS file itself; a relative name is
    looked up beside the VDS file, then from the working folder."""
    if name == ".":
        return vds
    given = Path(name)
    for candidate in (given,) if given.is_absolute() else (vds.parent / given, given):
        if candidate.is_file():
            return candidate
    return None


def _datasets(f: h5py.File) -> list[str]:
    """Every dataset in an HDF5 file, by absolute name."""
    names: list[str] = []
    f.visititems(lambda n, obj: names.append(f"/{n}") if isinstance(obj, h5py.Dataset) else None)
    return names
