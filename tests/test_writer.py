"""The write stage: docs/contract.md's output file, under a temporary name, complete last."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import xarray as xr

from volconv.output import (
    ROOT_ATTRS,
    OutputError,
    OutputExistsError,
    OutputWriteError,
    ResponseWriter,
    _direct_codec,
    check_output_path,
    chunk_shape,
    compression_options,
    holds,
    is_complete,
    private_prefix,
    staging,
)
from volconv.output import base as writer_module

NAMES = ["smooth", "dx", "blob"]
SHAPE = (10, 6, 5)
KERNELS = np.random.default_rng(1).random((3, 3, 5, 1))


def attrs() -> dict:
    """Every root attribute docs/contract.md lists, as the pipeline passes them."""
    return {
        "affine": np.diag([1.5, 2.0, 3.0, 1.0]),
        "voxel_size": (1.5, 2.0, 3.0),
        "source": "scans/a.nii.gz",
        "source_sha256": "0" * 64,
        "pipeline": "[input]\npaths = ['scans/*.nii.gz']\n",
        "volconv_version": "0.1.0",
        "device": "PoCL CPU",
        "gflop": 1.5,
        "kernel_seconds": 0.5,
        "wall_seconds": 2.0,
        "gflops": 3.0,
        "peak_gflops": 100.0,
        "fraction_of_peak": 0.03,
        "engine": "fp32",
    }


def responses(shape: tuple[int, ...] = SHAPE, scale: float = 100.0) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((len(NAMES), *shape)) * scale).astype(
        np.float32
    )


def writer(path: Path, shape: tuple[int, ...] = SHAPE, **options: object) -> ResponseWriter:
    options = {"boundary": "reflect", "cval": 0.0, "slab_depth": 4, **options}
    return ResponseWriter(path, shape, NAMES, KERNELS, **options)


def write(path: Path, data: np.ndarray, **options: object) -> Path:
    """Write ``data`` (N, x, y, z[, t]) slab by slab, frame by frame, and finish."""
    depth = options.get("slab_depth", 4)
    shape = data.shape[1:]
    with writer(path, shape, **options) as w:
        for t in range(shape[3] if len(shape) == 4 else 1):
            for a in range(0, shape[0], depth):
                b = min(a + depth, shape[0])
                slab = data[:, a:b] if len(shape) == 3 else data[:, a:b, ..., t]
                w.write_slab(a, b, slab.copy(), frame=t if len(shape) == 4 else None)
        return w.finish(attrs())


# HDF5 filter ids: 1 deflate (gzip), 2 shuffle, 32000 lzf, 32015 zstd (hdf5plugin).
FILTERS = {"none": set(), "gzip": {1, 2}, "gzip-6": {1, 2}, "lzf": {2, 32000}, "zstd": {32015}}


def filter_ids(ds: h5py.Dataset) -> set[int]:
    plist = ds.id.get_create_plist()
    return {plist.get_filter(i)[0] for i in range(plist.get_nfilters())}


@pytest.mark.parametrize("compression", FILTERS)
def test_float32_round_trip(tmp_path: Path, compression: str) -> None:
    if compression == "zstd":
        pytest.importorskip("hdf5plugin")
    data = responses()
    path = write(tmp_path / "out" / "a.h5", data, compression=compression)
    with h5py.File(path) as f:
        r = f["responses"]
        assert r.dtype == np.float32 and r.shape == (3, *SHAPE)
        np.testing.assert_array_equal(r[()], data)
        assert filter_ids(r) == FILTERS[compression]
        assert r.chunks == (1, 4, 6, 5)
        assert r.attrs["boundary"] == "reflect" and r.attrs["cval"] == 0.0
        k = f["kernels"]
        assert k.dtype == np.float32
        np.testing.assert_array_equal(k[()], KERNELS.astype(np.float32))
        expected = attrs()
        for key in ROOT_ATTRS:
            np.testing.assert_array_equal(f.attrs[key], expected[key])
        assert list(f.attrs)[-1] == "complete" and f.attrs["complete"]


def test_float16_rounds_and_saturates(tmp_path: Path) -> None:
    data = responses()
    data[0, 0, 0, :5] = [1e6, -1e6, np.inf, -np.inf, np.nan]
    with h5py.File(write(tmp_path / "h.h5", data, dtype="float16")) as f:
        stored = f["responses"][()]
    assert stored.dtype == np.float16
    # finite values saturate; infinities and NaN (as scipy gives them) stay what they are
    np.testing.assert_array_equal(stored[0, 0, 0, :5], [65504, -65504, np.inf, -np.inf, np.nan])
    stored, data = stored.astype(np.float32), data.copy()
    data[0, 0, 0, :5] = stored[0, 0, 0, :5]
    np.testing.assert_allclose(stored, data, rtol=2**-11)


def test_uint8_quantises_with_scale_and_offset(tmp_path: Path) -> None:
    scale, offset = 0.5, -20.0
    data = responses(scale=30.0)
    data[0, 0, 0, :3] = [-1e3, 1e3, np.nan]  # saturate low and high; NaN is stored as 0
    path = write(tmp_path / "u.h5", data, dtype="uint8", scale=scale, offset=offset)
    with h5py.File(path) as f:
        r = f["responses"]
        stored = r[()]
        assert (r.attrs["scale"], r.attrs["offset"]) == (scale, offset)
    assert stored.dtype == np.uint8
    assert list(stored[0, 0, 0, :3]) == [0, 255, 0]
    value = stored * scale + offset
    clipped = np.clip(data, offset, 255 * scale + offset)
    ok = np.isfinite(data)
    assert np.all(np.abs(value - clipped)[ok] <= scale * (0.5 + 1e-4))
    assert np.any((stored > 0) & (stored < 255))  # not all saturated
    # CF's scale_factor/add_offset: xarray decodes the stored values to the contract's value.
    with xr.open_dataset(path, engine="h5netcdf") as ds:
        np.testing.assert_allclose(ds.responses.values, value, rtol=1e-6)


def test_xarray_opens_named_dimensions(tmp_path: Path) -> None:
    data = responses((*SHAPE, 2))
    path = write(tmp_path / "four.h5", data)
    with xr.open_dataset(path, engine="h5netcdf") as ds:
        assert ds.responses.dims == ("filter", "x", "y", "z", "t")
        assert list(ds["filter"].values) == NAMES
        # world coordinates in mm from the affine (diag 1.5, 2, 3); no repetition time
        # given, so t counts frames
        assert ds.sizes["t"] == 2 and list(ds["t"].values) == [0, 1]
        for axis, step, n in zip("xyz", (1.5, 2.0, 3.0), SHAPE, strict=True):
            np.testing.assert_allclose(ds[axis].values, step * np.arange(n))
            assert ds[axis].attrs["units"] == "mm"
        np.testing.assert_array_equal(ds.responses.sel(filter="dx").values, data[1])
        assert ds.kernels.dims == ("filter", "kx", "ky", "kz")
        assert ds.attrs["source"] == "scans/a.nii.gz" and bool(ds.attrs["complete"])
    with h5py.File(path) as f:
        assert f["responses"].chunks == (1, 4, 6, 5, 1)


def test_chunks_are_filled_by_whole_slabs() -> None:
    assert chunk_shape((8, 128, 128, 128), 32, 4) == (1, 32, 128, 128)
    assert chunk_shape((8, 128, 128, 128, 3), 200, 4) == (1, 128, 128, 128, 1)
    # 16 MiB planes: at most 4 fit in 64 MiB, and the depth must divide the slab of 10.
    assert chunk_shape((2, 100, 2048, 2048), 10, 4) == (1, 2, 2048, 2048)
    assert chunk_shape((2, 100, 2048, 2048), 10, 1) == (1, 10, 2048, 2048)
    assert chunk_shape((2, 100, 8192, 8192), 10, 4) == (1, 1, 8192, 8192)


@pytest.mark.parametrize(("compression", "depth"), [("none", 32), ("gzip", 4), ("lzf", 4),
                                                    ("zstd", 32)])  # fmt: skip
def test_chunks_compressed_on_the_pool_are_small_enough_for_every_core(tmp_path, compression,
                                                                       depth):  # fmt: skip
    """gzip and lzf chunks of at most 1 MiB (a slab of 3 x 32 x 256^2 float32 makes 24, for
    the pool's cores); others up to 64 MiB."""
    if compression == "zstd":
        pytest.importorskip("hdf5plugin")
    data = np.zeros((3, 32, 256, 256), np.float32)
    path = write(tmp_path / "a.h5", data, slab_depth=32, compression=compression)
    with h5py.File(path) as f:
        assert f["responses"].chunks == (1, depth, 256, 256)
        np.testing.assert_array_equal(f["responses"][()], data)


def test_temp_file_until_finished_then_renamed(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "out.h5"
    data = responses()
    with writer(path) as w:
        temp = w.temp
        folder = temp.parent  # private: this process's alone, under a name nobody predicts
        assert folder.parent == path.parent and folder.name.startswith(private_prefix(path))
        assert folder.stat().st_mode & 0o777 == 0o700 and temp.is_file()
        # A second writer of the same path gets a folder of its own.
        with pytest.raises(RuntimeError, match="without finish"), writer(path) as other:
            assert other.temp.parent not in (folder, path.parent)
        for a in range(0, SHAPE[0], 4):
            w.write_slab(a, min(a + 4, SHAPE[0]), data[:, a : a + 4].copy())
        assert temp.exists() and not path.exists() and not is_complete(temp)
        assert w.finish(attrs()) == path
    assert is_complete(path) and list(path.parent.iterdir()) == [path]
    assert w.write_seconds > 0


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_exception_leaves_no_file(tmp_path: Path, error: type[BaseException]) -> None:
    path = tmp_path / "out.h5"
    with pytest.raises(error), writer(path) as w:
        w.write_slab(0, 4, responses()[:, :4].copy())
        raise error
    assert list(tmp_path.iterdir()) == []


def test_missing_rows_are_never_marked_complete(tmp_path: Path) -> None:
    path = tmp_path / "out.h5"
    with pytest.raises(RuntimeError, match="row 4 of frame 0"), writer(path) as w:
        w.write_slab(0, 4, responses()[:, :4].copy())
        w.finish(attrs())
    assert list(tmp_path.iterdir()) == []


def test_writer_thread_errors_raise_in_the_caller(tmp_path: Path) -> None:
    path = tmp_path / "out.h5"
    unwritable = np.full((3, 4, *SHAPE[1:]), "text", dtype=object)
    with pytest.raises(RuntimeError, match="writing failed"), writer(path) as w:
        w.write_slab(0, 4, unwritable)
        w.finish(attrs())
    assert list(tmp_path.iterdir()) == []


def test_existing_files_need_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "out.h5"
    path.write_text("someone's notes")
    with pytest.raises(OutputExistsError, match="not a complete volconv output") as info:
        writer(path)
    assert isinstance(info.value, FileExistsError | ValueError) and str(path) in str(info.value)
    assert path.read_text() == "someone's notes" and list(tmp_path.iterdir()) == [path]

    write(path, responses(), overwrite=True)
    assert is_complete(path)
    with pytest.raises(OutputExistsError, match="already complete"):
        writer(path)
    data = responses() + 1
    write(path, data, overwrite=True)
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["responses"][()], data)


@pytest.mark.parametrize("swaps", [True, False], ids=["swapped", "replaced"])
def test_a_replaced_file_stays_whole_until_the_new_one_is_complete(tmp_path, monkeypatch, swaps):
    """With overwrite the old output stays at its path, intact, while the new one is written
    and when writing it fails; then the new one is swapped in at once (where the file system
    can: else replaced), the old one going with the private folder, in the background;
    nothing is left beside it."""
    if not swaps:
        monkeypatch.setattr(writer_module, "_swap", lambda a, b: False)
    path = tmp_path / "out.h5"
    old = responses()
    write(path, old)
    inode = path.stat().st_ino
    with pytest.raises(RuntimeError, match="cut"), writer(path, overwrite=True) as w:
        w.write_slab(0, 4, (old[:, :4] + 1).copy())
        raise RuntimeError("cut")
    assert list(tmp_path.iterdir()) == [path] and path.stat().st_ino == inode
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["responses"][()], old)

    later: list[Path] = []
    monkeypatch.setattr(writer_module, "remove_later", later.append)
    write(path, old + 1, overwrite=True)
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["responses"][()], old + 1)
    if not swaps:
        assert not later and list(tmp_path.iterdir()) == [path]
        return
    (folder,) = later  # the old file, whole, in the private folder only
    assert folder.name.startswith(private_prefix(path))
    assert [p.name for p in folder.iterdir()] == ["out.h5.replaced"]
    assert (folder / "out.h5.replaced").stat().st_ino == inode
    with h5py.File(folder / "out.h5.replaced") as f:
        np.testing.assert_array_equal(f["responses"][()], old)
    monkeypatch.undo()
    staging.remove_later(folder)
    staging.wait_for_removals()
    assert list(tmp_path.iterdir()) == [path]

    write(path, old, overwrite=True)  # the real thing: nothing left once joined
    staging.wait_for_removals()
    assert list(tmp_path.iterdir()) == [path]


def test_bad_options_name_the_value(tmp_path: Path) -> None:
    with pytest.raises(OutputError, match="'brotli'"):
        writer(tmp_path / "a.h5", compression="brotli")
    with pytest.raises(OutputError, match="'int32'"):
        writer(tmp_path / "a.h5", dtype="int32")
    with pytest.raises(OutputError, match="scale"):
        writer(tmp_path / "a.h5", dtype="uint8", scale=0.0)
    (tmp_path / "dir.h5").mkdir()
    with pytest.raises(OutputError, match=r"dir\.h5"):
        writer(tmp_path / "dir.h5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.h5"]


def test_write_slab_and_finish_check_their_arguments(tmp_path: Path) -> None:
    path = tmp_path / "a.h5"
    with pytest.raises(RuntimeError, match="without finish"), writer(path, (*SHAPE, 2)) as w:
        with pytest.raises(ValueError, match="shape"):
            w.write_slab(0, 4, np.zeros((3, 3, 6, 5), np.float32), frame=0)
        with pytest.raises(ValueError, match="frame"):
            w.write_slab(0, 4, np.zeros((3, 4, 6, 5), np.float32))
        with pytest.raises(ValueError, match="rows"):
            w.write_slab(8, 12, np.zeros((3, 4, 6, 5), np.float32), frame=1)
    with pytest.raises(ValueError, match="missing root attributes device"), writer(path) as w:
        for a in range(0, SHAPE[0], 4):
            w.write_slab(a, min(a + 4, SHAPE[0]), responses()[:, a : a + 4].copy())
        w.finish({k: v for k, v in attrs().items() if k != "device"})
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    path = tmp_path / "out.h5"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = dead.stdout.strip()
    start = f".out.h5.partial-{socket.gethostname()}"
    (tmp_path / f"{start}-{pid}.h5").write_bytes(b"left by a killed run of an older volconv")
    stale = tmp_path / f"{start}-{pid}-k3x9q0ab"
    stale.mkdir(mode=0o700)
    (stale / "out.h5").write_bytes(b"left by a killed run")
    # Not removed: a live process's (this one's), and what is not clearly a dead run's.
    live = tmp_path / f"{private_prefix(path)}zz9"
    live.mkdir()
    other_host = tmp_path / f".out.h5.partial-elsewhere-{pid}-abc"
    other_host.mkdir()
    write(path, responses())
    assert sorted(tmp_path.iterdir()) == sorted([path, live, other_host])


def test_release_is_called_once_per_slab_even_after_an_error(tmp_path: Path) -> None:
    """Reused (pinned) buffers come back to the caller whether their slab was written or not."""
    released: list[int] = []
    data = responses()
    with writer(tmp_path / "ok.h5") as w:
        for a in range(0, SHAPE[0], 4):
            b = min(a + 4, SHAPE[0])
            w.write_slab(a, b, data[:, a:b], release=lambda a=a: released.append(a))
        path = w.finish(attrs())
    assert sorted(released) == [0, 4, 8]
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["responses"][...], data)

    released.clear()
    unwritable = np.full((3, 4, *SHAPE[1:]), "text", dtype=object)
    with pytest.raises(RuntimeError, match="writing failed"), writer(tmp_path / "bad.h5") as w:
        w.write_slab(0, 4, unwritable, release=lambda: released.append(0))
        w.finish(attrs())
    assert released == [0]


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_buffer_is_reused_only_once_its_compressed_slab_is_done(tmp_path, compression, dtype):
    """Compressed chunks of two slabs are in flight at once (`SLABS_IN_FLIGHT`), each
    written as soon as it is made: a buffer given back (`release`) is overwritten at once, as
    the pipeline's pinned buffers are, and what the file holds is still every slab's data;
    with an error in the middle every buffer still comes back, once."""
    rng = np.random.default_rng(3)
    data = (rng.standard_normal((3, 40, 64, 48)) * 100).astype(dtype)
    free = [np.empty((3, 2, 64, 48), dtype) for _ in range(3)]
    lent = threading.Semaphore(len(free))

    def give_back(buffer: np.ndarray) -> None:
        buffer.fill(np.nan)  # reused at once: a late reader would see it
        free.append(buffer)
        lent.release()

    path = tmp_path / "a.h5"
    with writer(path, data.shape[1:], dtype=dtype, compression=compression, slab_depth=2) as w:
        for a in range(0, 40, 2):
            lent.acquire()
            buffer = free.pop()
            buffer[...] = data[:, a : a + 2]
            w.write_slab(a, a + 2, buffer, release=lambda buffer=buffer: give_back(buffer))
        w.finish(attrs())
    assert len(free) == 3
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["responses"][()], data)

    released: list[int] = []
    unwritable = np.full((3, 2, 64, 48), "text", dtype=object)
    with (
        pytest.raises(RuntimeError, match="writing failed"),
        writer(
            tmp_path / "bad.h5", data.shape[1:], dtype=dtype, compression=compression, slab_depth=2
        ) as w,
    ):
        for a in range(0, 40, 2):
            given = unwritable if a == 10 else data[:, a : a + 2]
            w.write_slab(a, a + 2, given, release=lambda a=a: released.append(a))
        w.finish(attrs())
    assert sorted(released) == list(range(0, 40, 2))[: len(released)] and 10 in released


# -- trust: links planted by others, a full disk, outputs that cannot be made ----------------
def test_planted_links_never_redirect_the_writes(tmp_path: Path) -> None:
    """Links at every name a temporary file had or might have, pointing at someone's file,
    leave that file unchanged; the output is whole and only the writer's own file lands."""
    victim = tmp_path / "victim" / "thesis.tex"
    victim.parent.mkdir()
    victim.write_text("four years of work")
    victim_dir = tmp_path / "victim" / "data"
    victim_dir.mkdir()
    (victim_dir / "keep.txt").write_text("keep")
    out = tmp_path / "shared"
    out.mkdir()
    path = out / "a.h5"
    host, pid = socket.gethostname(), os.getpid()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)  # fmt: skip
    pids = dict.fromkeys((pid, dead, *range(pid + 1, pid + 50)))
    planted = [out / f".a.h5.partial-{host}-{p}.h5" for p in pids]
    planted += [out / f".a.h5.partial-{host}-{p}-{r}" for p in (pid, dead) for r in ("x", "0")]
    planted += [out / f"{private_prefix(path)}{c * 8}" for c in "abcdefgh_0123456789"]
    for link in planted:
        link.symlink_to(victim)
    dir_links = [
        out / f".a.h5.partial-{host}-{dead}-dirlink",
        out / f".a.h5.partial-{host}-{dead}.h5d",
    ]
    for link in dir_links:
        link.symlink_to(victim_dir, target_is_directory=True)
    data = responses()
    write(path, data)
    assert victim.read_text() == "four years of work"
    assert [p.name for p in victim_dir.iterdir()] == ["keep.txt"]
    assert all(link.is_symlink() for link in planted + dir_links)  # not removed either
    assert not path.is_symlink() and is_complete(path)
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["responses"][()], data)
    assert sorted(out.iterdir()) == sorted([path, *planted, *dir_links])


def test_stale_entries_of_others_are_left_alone(tmp_path: Path) -> None:
    """Removal of a dead run's leftovers takes only this user's real folders and files."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    path = tmp_path / "a.h5"
    theirs = tmp_path / f".a.h5.partial-{socket.gethostname()}-{dead}-abc"
    theirs.mkdir()
    (theirs / "a.h5").write_text("another user's run")
    os.chown(theirs, 65534, 65534)
    write(path, responses())
    assert (theirs / "a.h5").read_text() == "another user's run"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_link_at_the_output_path_is_replaced_not_followed(tmp_path: Path, overwrite: bool):
    victim = tmp_path / "victim.txt"
    path = tmp_path / "out" / "a.h5"
    path.parent.mkdir()
    if overwrite:  # a link to an existing file: replaced by the output when overwriting
        victim.write_text("someone's notes")
    path.symlink_to(victim)  # else a dangling link: nothing is there to protect
    data = responses()
    write(path, data, overwrite=overwrite)
    assert not path.is_symlink() and is_complete(path)
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["responses"][()], data)
    if overwrite:
        assert victim.read_text() == "someone's notes"
    else:
        assert not victim.exists()


def test_a_link_to_a_file_at_the_output_path_needs_overwrite(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's notes")
    path = tmp_path / "a.h5"
    path.symlink_to(victim)
    with pytest.raises(OutputExistsError, match="not a complete volconv output"):
        writer(path)
    assert victim.read_text() == "someone's notes" and path.is_symlink()


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 4 MiB tmpfs (we mount it; skipped with the reason where mounting is not allowed)."""
    where = tmp_path / "fs"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


# Writes a (3, 64, 64, 64) float32 output (3 MiB) in slabs of 8 rows and reports how it ends;
# a crash of the process (SIGSEGV) shows as its exit status.
DISK_FULL_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from volconv.output import OutputWriteError, ResponseWriter
    path, chunked = sys.argv[1], sys.argv[2] == "big-chunks"
    shape = (64, 64, 64)
    kernels = np.ones((3, 3, 3, 3), np.float32)
    attrs = dict.fromkeys(("affine voxel_size source source_sha256 pipeline device gflop "
                           "kernel_seconds wall_seconds gflops peak_gflops fraction_of_peak "
                           "engine").split(), 1.0)
    depth = 64 if chunked else 8
    try:
        with ResponseWriter(path, shape, ["a", "b", "c"], kernels, boundary="reflect",
                            cval=0.0, slab_depth=depth) as w:
            for a in range(0, 64, depth):
                w.write_slab(a, a + depth, np.ones((3, depth, 64, 64), np.float32))
            w.finish(attrs)
    except OutputWriteError as e:
        print(str(e))
        sys.exit(3)
""")


@pytest.mark.parametrize("chunks", ["small-chunks", "big-chunks"])
def test_disk_full_is_a_clean_error_and_a_rerun_completes(small_fs: Path, chunks: str) -> None:
    """Chunks below HDF5's 1 MiB cache fail when the file is flushed, larger ones in the
    writer thread: either way one line naming the output and the cause, nothing left."""
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (3 * 2**20))
    path = small_fs / "out" / "a.h5"
    run = subprocess.run([sys.executable, "-c", DISK_FULL_SCRIPT, str(path), chunks],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 3, (run.returncode, run.stdout, run.stderr)
    assert run.stdout == f"{path}: cannot write it: No space left on device\n"
    assert run.stderr == ""
    # Not the user's mistake: the CLI's exit 1, where OutputError (a ValueError) is exit 2.
    assert issubclass(OutputWriteError, OSError) and not issubclass(OutputWriteError, ValueError)
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler", "out"]
    assert list((small_fs / "out").iterdir()) == []  # no output, no temporary file
    filler.unlink()  # space freed: the rerun completes
    data = np.random.default_rng(2).random((3, 64, 64, 64), np.float32)
    write(path, data, slab_depth=8 if chunks == "small-chunks" else 64)
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["responses"][()], data)
    assert list((small_fs / "out").iterdir()) == [path]


@pytest.mark.parametrize("chunks", ["small-chunks", "big-chunks"])
def test_disk_full_by_file_size_limit(tmp_path: Path, chunks: str) -> None:
    """The same without a mount: RLIMIT_FSIZE makes writes fail (EFBIG) in a subprocess."""
    path = tmp_path / "a.h5"
    limit = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             "resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))\n")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", limit + DISK_FULL_SCRIPT, str(path), chunks],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 3, (run.returncode, run.stdout, run.stderr)
    assert run.stdout == f"{path}: cannot write it: File too large\n"
    assert list(tmp_path.iterdir()) == []


def test_extents_and_uint8_clipping_are_recorded(tmp_path: Path) -> None:
    extents = np.array([[3, 5, 1], [1, 3, 1], [3, 5, 1]])
    data = responses(scale=30.0)
    data[0, 0, 0, :4] = [-1e3, 1e3, np.nan, np.inf]
    expected_clipped = int(np.sum(np.rint(data) < 0) + np.sum(np.rint(data) > 255))
    with writer(tmp_path / "a.h5", dtype="uint8", extents=extents) as w:
        for a in range(0, SHAPE[0], 4):
            w.write_slab(a, min(a + 4, SHAPE[0]), data[:, a : a + 4].copy())
        path = w.finish(attrs())
    assert (w.clipped, w.nans) == (expected_clipped, 1) and w.clipped > 2
    with h5py.File(path) as f:
        stored = f["kernels"].attrs["extents"]
        assert f.attrs["engine"] == "fp32"
    assert stored.dtype.kind == "i" and stored.tolist() == extents.tolist()
    with writer(tmp_path / "b.h5") as w:  # default: the common extent; float32 clips nothing
        for a in range(0, SHAPE[0], 4):
            w.write_slab(a, min(a + 4, SHAPE[0]), data[:, a : a + 4].copy())
        path = w.finish(attrs())
    assert (w.clipped, w.nans) == (0, 0)
    with h5py.File(path) as f:
        assert f["kernels"].attrs["extents"].tolist() == [[3, 5, 1]] * 3
    with pytest.raises(ValueError, match="extents"):
        writer(tmp_path / "c.h5", extents=[[3, 7, 1]] * 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.h5", "b.h5"]


def test_check_output_path(tmp_path: Path) -> None:
    check_output_path(tmp_path / "a.h5")
    check_output_path(tmp_path / "new" / "deeper" / "a.h5")  # folders to be created
    (tmp_path / "dir.h5").mkdir()
    with pytest.raises(OutputError, match=r"dir\.h5: is a folder"):
        check_output_path(tmp_path / "dir.h5")
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="file is not a folder"):
        check_output_path(tmp_path / "file" / "a.h5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.h5", "file"]


def test_check_output_path_on_a_read_only_file_system(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        for path in (ro / "a.h5", ro / "missing" / "folder" / "a.h5"):
            with pytest.raises(OutputError, match=f"{path}: .*{ro} is on a read-only file"):
                check_output_path(path)
            with pytest.raises(OutputError, match=str(path)):
                writer(path)  # what `run` meets
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any folder")
def test_check_output_path_without_permission(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(OutputError, match="no permission to write in"):
        check_output_path(locked / "sub" / "a.h5")


@pytest.mark.parametrize("compression", ["none", "gzip", "gzip-9", "lzf"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8"])
@pytest.mark.parametrize("shape", [(10, 6, 5), (9, 4, 3, 2)], ids=["3d", "4d"])
def test_chunks_written_directly_read_back_in_any_reader(tmp_path, compression, dtype, shape):
    """Chunks encoded by volconv (write_direct_chunk; shuffle + deflate or LZF made on the
    pool; uncompressed straight from the slab) read back through HDF5's own filters, edge
    chunks included (slabs of 4 over 10 or 9 rows); noise LZF cannot shrink is stored as
    HDF5 stores it, the filter's bit set in the chunk's mask."""
    assert _direct_codec(compression_options(compression)) is not None  # made by volconv
    data = np.random.default_rng(5).random((3, *shape)).astype(np.float32) * 200
    data[1] = np.linspace(0, 1, data[1].size).reshape(data[1].shape)  # compressible
    path = write(tmp_path / "a.h5", data, compression=compression, dtype=dtype, slab_depth=4)
    with h5py.File(path) as f:
        stored = f["responses"][()]
        codec = compression.split("-")[0]
        assert f["responses"].compression == (None if codec == "none" else codec)
        masks = {f["responses"].id.get_chunk_info(i).filter_mask
                 for i in range(f["responses"].id.get_num_chunks())}  # fmt: skip
        if codec == "lzf":  # noise in uint8 never shrinks; the ramp does
            assert 0 in masks and masks <= {0, 2} and (2 in masks or dtype != "uint8")
        else:
            assert masks == {0}
    want = {"float32": data, "float16": data.astype(np.float16),
            "uint8": np.clip(np.rint(data), 0, 255).astype(np.uint8)}[dtype]  # fmt: skip
    np.testing.assert_array_equal(stored, want)


def test_a_fifo_is_never_opened_nor_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "a.h5"
    os.mkfifo(fifo)
    link = tmp_path / "link.h5"
    link.symlink_to(fifo)
    answers: list = []
    probe = threading.Thread(
        target=lambda: answers.extend([is_complete(fifo), is_complete(link), holds(link)]),
        daemon=True,
    )
    probe.start()
    probe.join(10)
    if probe.is_alive():  # opened it, blocked on it: let it go, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("a FIFO at the output path was opened")
    assert answers == [False, False, "a FIFO (named pipe)"]
    for overwrite in (False, True):
        with pytest.raises(OutputError, match=r"a\.h5: is a FIFO .*, not a regular file"):
            check_output_path(fifo)
        with pytest.raises(OutputError, match="is a FIFO"):
            writer(fifo, overwrite=overwrite)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    check_output_path(link)  # a link is replaced, never followed: allowed


def test_a_name_too_long_for_the_file_system_is_an_output_error(tmp_path: Path) -> None:
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    extra = len(private_prefix(tmp_path / "a")) - 1 + 8  # the private folder's name adds these
    longest = name_max - extra  # of a file name that its private folder's name fits
    check_output_path(tmp_path / ("x" * (longest - 3) + ".h5"))
    with pytest.raises(OutputError, match="file name is too long"):
        check_output_path(tmp_path / ("x" * (longest - 2) + ".h5"))  # fits; its folder not
    with pytest.raises(OutputError, match=r"folder name x+\.\.\. is too long"):
        check_output_path(tmp_path / ("x" * (name_max + 1)) / "a.h5")
    with pytest.raises(OutputError, match="is too long"):
        writer(tmp_path / ("x" * (name_max + 1) + ".h5"))
    assert not any(tmp_path.iterdir())


def test_holds_says_what_a_file_is(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("[input]\n")
    (tmp_path / "e").write_bytes(b"")
    (tmp_path / "b").write_bytes(bytes(range(256)))
    np.save(tmp_path / "a.npy", np.zeros(3))
    with h5py.File(tmp_path / "h.h5", "w"):
        pass
    assert [holds(tmp_path / n) for n in ("t", "e", "b", "a.npy", "h.h5", "none")] == [
        "text", "an empty file", "binary data, not HDF5", "a NumPy array (.npy)",
        "an HDF5 file without complete = True", "nothing",
    ]  # fmt: skip
