"""A fast start that keeps every safety property: the driver and the context started ahead in
the background, pinned slab buffers made as the run needs them, and a replaced output freed
in the background while the old file stays whole until the new one is complete
(scripts/bench/start.py measures the start)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import h5py
import nibabel as nib
import numpy as np
import pyopencl as cl
import pytest
from test_pipeline import DEVICE, ROOT, check_output, random_volume, volconv, write_pipeline

from volconv import cli
from volconv.device import cache, driver, programs, start
from volconv.engines.separable import SeparableConvolver
from volconv.output.space import Space
from volconv.run.convolvers import PinnedSlabs
from volconv.run.inputs import open_volume
from volconv.run.volume import InputError

BOX = [{"type": "box"}, {"type": "gaussian", "sigma": 1.0}]


def test_a_context_started_ahead_is_the_one_taken(device, monkeypatch) -> None:
    monkeypatch.setattr(programs, "_MADE", set())  # as in a new process
    driver.start_driver()
    driver.driver_started()
    programs.start_context(device)
    started = programs._CONTEXTS[device.int_ptr]
    ctx, queue = programs._context_for.__wrapped__(device)  # not the process's cached one
    assert ctx.int_ptr == started.result() and device.int_ptr not in programs._CONTEXTS
    assert ctx.devices == [device]
    data = np.arange(64, dtype=np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=data)
    back = np.empty_like(data)
    cl.enqueue_copy(queue, back, buf)
    np.testing.assert_array_equal(back, data)


def test_pinned_slabs_are_made_as_the_run_needs_them() -> None:
    made: list[np.ndarray] = []

    def make() -> np.ndarray:
        made.append(np.zeros(4))
        return made[-1]

    slabs = PinnedSlabs(make, 3)
    a = slabs.get()  # the first, made in the background from the start
    slabs.put(a)
    assert slabs.get() is a and len(made) == 1  # a free one is taken before a new one
    b, c = slabs.get(), slabs.get()
    assert len(made) == 3 and len({id(x) for x in (a, b, c)}) == 3
    taken: list[np.ndarray] = []
    waiting = threading.Thread(target=lambda: taken.append(slabs.get()))
    waiting.start()  # none free, three made: it waits for one to come back
    waiting.join(0.2)
    assert waiting.is_alive() and not taken
    slabs.put(b)
    waiting.join(5)
    assert taken == [b] and len(made) == 3


def test_a_failure_to_make_the_first_pinned_slab_raises_where_it_is_taken() -> None:
    def make() -> np.ndarray:
        raise MemoryError("no page-locked memory")

    with pytest.raises(MemoryError, match="page-locked"):
        PinnedSlabs(make, 3).get()


def test_overwrite_replaces_the_output_and_leaves_nothing_beside_it(tmp_path, capsys) -> None:
    volume = random_volume((9, 7, 6), "uint8")
    np.save(tmp_path / "scan.npy", volume)
    pipeline = write_pipeline(tmp_path, BOX, run={"slab_depth": 3})
    assert volconv("run", pipeline, capsys=capsys)[0] == 0
    out = tmp_path / "out" / "scan.h5"
    first = out.stat().st_ino
    assert volconv("run", pipeline, "--overwrite", capsys=capsys)[0] == 0
    assert out.stat().st_ino != first and list(out.parent.iterdir()) == [out]
    check_output(out, volume).close()


def test_a_process_leaves_the_replaced_output_to_an_rm_process(tmp_path, capsys) -> None:
    """`volconv run --overwrite` as a process of its own returns without waiting for the
    file system to free the output it replaced (a slow ``rm`` here): that process frees it
    after; the new output is complete when the command returns."""
    volume = random_volume((9, 7, 6), "uint8")
    np.save(tmp_path / "scan.npy", volume)
    pipeline = write_pipeline(tmp_path, BOX, run={"slab_depth": 3})
    assert volconv("run", pipeline, capsys=capsys)[0] == 0
    out = tmp_path / "out" / "scan.h5"
    slow = tmp_path / "bin"
    slow.mkdir()
    (slow / "rm").write_text(f'#!/bin/sh\nsleep 2\nexec {shutil.which("rm")} "$@"\n')
    (slow / "rm").chmod(0o755)
    env = {**os.environ, "PATH": f"{slow}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([sys.executable, "-m", "volconv", "run", str(pipeline), "--overwrite"],
                   cwd=ROOT, env=env, check=True, capture_output=True)  # fmt: skip
    assert len(list(out.parent.iterdir())) == 2  # the old file's folder, still there
    check_output(out, volume).close()
    for _ in range(100):
        if list(out.parent.iterdir()) == [out]:
            break
        time.sleep(0.1)
    assert list(out.parent.iterdir()) == [out]


def test_an_overwrite_that_fails_keeps_the_old_output_whole(tmp_path, capsys, monkeypatch):
    """A run with --overwrite that fails before its new file is complete (here the device,
    at the second slab) leaves the old output as it was, and nothing beside it."""
    volume = random_volume((9, 7, 6), "uint8")
    np.save(tmp_path / "scan.npy", volume)
    pipeline = write_pipeline(tmp_path, BOX, run={"slab_depth": 3})
    assert volconv("run", pipeline, capsys=capsys)[0] == 0
    out = tmp_path / "out" / "scan.h5"
    with h5py.File(out) as f:
        old = f["responses"][()]
    inode = out.stat().st_ino
    real = SeparableConvolver.convolve_slab
    slabs = []

    def failing(self, a, b, **kwargs):
        slabs.append(a)
        if len(slabs) == 2:
            raise cl.RuntimeError("the device was lost")
        return real(self, a, b, **kwargs)

    monkeypatch.setattr(SeparableConvolver, "convolve_slab", failing)
    code, out_text, err = volconv("run", pipeline, "--overwrite", capsys=capsys)
    assert code == 1 and "device was lost" in out_text + err
    assert out.stat().st_ino == inode and list(out.parent.iterdir()) == [out]
    with h5py.File(out) as f:
        np.testing.assert_array_equal(f["responses"][()], old)
        assert f.attrs["complete"]


LEAVE = (
    "import os, sys\n"
    "import pyopencl\n"
    "from volconv.device import driver\n"
    "driver.start_driver(); driver.driver_started()\n"
    "fork = os.fork\n"
    "def noted():\n"
    "    print('forked', flush=True)\n"
    "    return fork()\n"
    "os.fork = noted\n"
    "driver.leave(int(sys.argv[1]))  # volconv-leave-test\n"
)


def _leaving() -> list[int]:
    """The processes still running LEAVE (its child, after it ended)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"volconv-leave-test" in f.read() and entry.isdigit():
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("status", [0, 3])
def test_a_program_leaves_the_drivers_teardown_to_a_child(status) -> None:
    """`driver.leave`: a process that loaded the OpenCL driver ends at once with its status,
    its stdout and stderr ending with it (the reader of its pipes is not kept waiting); the
    child it forked to hold the driver's files ends right after it."""
    done = subprocess.run([sys.executable, "-c", LEAVE, str(status)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert done.returncode == status, done.stderr
    assert done.stdout.split() == ["forked"] and not done.stderr, done
    deadline = time.monotonic() + 10
    while _leaving() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _leaving()


RUN_IMPORTS = (
    "import sys; from volconv.cli import main; names = sys.argv[2:]\n"
    "sys.argv = ['volconv', 'run', sys.argv[1]]\n"
    "try: main()\nexcept SystemExit as e: assert not e.code, e.code\n"
    "print(sorted(m for m in names if m in sys.modules))"
)
# Never needed by `volconv run` on a file nibabel need not read (nibabel 0.2-0.3 s of a
# start on the GPU node; the others are for `show`, `bench --plot`, `--set` and custom
# kernels); the progress bar on a terminal only.
NOT_FOR_A_RUN = ("nibabel", "matplotlib", "scipy", "rich.progress", "tomli_w", "distributed")


@pytest.mark.parametrize("name", ["scan.npy", "scan.nii"])
def test_a_run_imports_only_what_it_needs(tmp_path, name) -> None:
    """A run of a .npy or a plain .nii input, written to a pipe, in a process of its own."""
    data = random_volume((5, 4, 3), "uint8")
    if name.endswith(".nii"):
        nib.save(nib.Nifti1Image(data, np.diag([2.0, 1.5, 1.0, 1.0])), tmp_path / name)
    else:
        np.save(tmp_path / name, data)
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": [name]})
    done = subprocess.run([sys.executable, "-c", RUN_IMPORTS, str(pipeline), *NOT_FOR_A_RUN],
                          capture_output=True, text=True, cwd=ROOT, check=True)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
    check_output(tmp_path / "out" / "scan.h5", data).close()


def test_a_run_of_a_scaled_nifti_imports_nibabel(tmp_path) -> None:
    """The guard above can fail: a NIfTI nibabel must read (scl_slope 2) imports it."""
    _scaled(tmp_path / "scan.nii", random_volume((5, 4, 3), "int16"))
    pipeline = write_pipeline(tmp_path, BOX, input={"paths": ["scan.nii"]})
    done = subprocess.run([sys.executable, "-c", RUN_IMPORTS, str(pipeline), "nibabel"],
                          capture_output=True, text=True, cwd=ROOT, check=True)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "['nibabel']", done.stdout + done.stderr


AFFINE = np.array([[-1.5, 0.1, 0, 90], [0, 2, 0.2, -126], [0, 0, 2.5, -72], [0, 0, 0, 1]])


def _plain(path, data, **header):
    img = nib.Nifti1Image(data, AFFINE)
    for key, value in header.items():
        img.header[key] = value
    nib.save(img, path)


def _slope_inter(path, slope, inter):  # in the file: nibabel's save sets its own
    raw = bytearray(path.read_bytes())
    raw[112:120] = np.array([slope, inter], "<f4").tobytes()
    path.write_bytes(bytes(raw))


def _scaled(path, data):
    _plain(path, data)
    _slope_inter(path, 0.5, -3.0)


def _units(path, data):  # microns and a repetition time of 2.5 ms
    img = nib.Nifti1Image(data, AFFINE)
    img.header.set_xyzt_units("micron", "msec")
    img.header["pixdim"][4] = 2.5
    nib.save(img, path)


def _qform_only(path, data):
    img = nib.Nifti1Image(data, None)
    img.set_qform(np.diag([1.2, 0.9, 2.0, 1.0]), code=1)
    img.set_sform(None, code=0)
    nib.save(img, path)


def _big_endian(path, data):
    header = nib.Nifti1Header(endianness=">")
    img = nib.Nifti1Image(data, AFFINE, header=header)
    img.set_data_dtype(data.dtype.newbyteorder(">"))
    nib.save(img, path)


def _extension(path, data):
    img = nib.Nifti1Image(data, AFFINE)
    img.header.extensions.append(nib.nifti1.Nifti1Extension("comment", b"a comment"))
    nib.save(img, path)


def _slope_one(path, data):  # nibabel's proxy leaves slope 1, inter 0 unscaled
    _plain(path, data)
    _slope_inter(path, 1.0, 0.0)


ZERO = [1, 0, 1, 1, 1, 1, 1, 1]  # pixdim: no voxel size along x
NIFTIS = {  # (shape, dtype, writer): the plain ones open without nibabel, the rest with it
    "uint8 3D": ((9, 8, 7), "uint8", _plain),
    "float32 4D": ((9, 8, 7, 3), "float32", _plain),
    "int16 4D in microns and ms": ((6, 5, 4, 3), "int16", _units),
    "int16 4D of one frame": ((6, 5, 4, 1), "int16", _plain),
    "uint16 5D with a trailing 1": ((6, 5, 4, 2, 1), "uint16", _plain),
    "float64, zero voxel size": ((6, 5, 4), "float64", lambda p, d: _plain(p, d, pixdim=ZERO)),
    "int8, slope 1 inter 0 in the file": ((6, 5, 4), "int8", _slope_one),
    "scaled": ((6, 5, 4), "int16", _scaled),
    "qform only": ((6, 5, 4), "int16", _qform_only),
    "big-endian": ((6, 5, 4), "int16", _big_endian),
    "with an extension": ((6, 5, 4), "uint8", _extension),
}  # fmt: skip


@pytest.mark.parametrize("case", NIFTIS)
def test_a_nifti_opens_as_nibabel_reads_it(tmp_path, case) -> None:
    """Whether or not nibabel reads it, a .nii input is what nibabel gives: voxels (whole
    frames and rows), type after scaling, affine, voxel size and whether it has one."""
    shape, dtype, write = NIFTIS[case]
    data = random_volume(shape, dtype)
    path = tmp_path / "scan.nii"
    write(path, data)
    vol = open_volume(path)
    img = nib.load(path)
    want = np.asanyarray(img.dataobj)
    want = want.reshape(want.shape[:4]) if want.ndim > 4 else want
    assert vol.dtype == want.dtype.newbyteorder("=") and vol.shape == want.shape
    np.testing.assert_array_equal(vol.affine, img.affine)
    raw_zooms = nib.Nifti1Header.from_fileobj(path.open("rb"), check=False).get_zooms()[:3]
    assert vol.voxel_size == tuple(float(z) for z in img.header.get_zooms()[:3])
    assert (vol.voxel_unknown == "") == all(z > 0 for z in raw_zooms)
    rows = np.array([4, 0, 1, 2, 5])
    for t in range(vol.n_frames):
        frame = want[..., t] if want.ndim == 4 else want
        np.testing.assert_array_equal(vol.read_frame(t), frame)
        np.testing.assert_array_equal(vol.read_rows(rows, t), frame[rows])
    # mapped (read as used): a 3D file that is neither scaled nor in the other byte order
    assert vol.mapped == (len(shape) == 3 and case not in ("scaled", "big-endian"))
    # read without nibabel where the file is plain (the others: nibabel's)
    plain = ("uint8 3D", "float32 4D", "int16 4D of one frame", "int16 4D in microns and ms",
             "int8, slope 1 inter 0 in the file")  # fmt: skip
    assert (vol.nifti_header is not None) == (case in plain)
    # and the space the outputs record, as from nibabel's header
    got, want = Space.of(vol), Space.of(dataclasses.replace(vol, nifti_header=None))
    for name in ("affine", "sform", "qform"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) or np.array_equal(a, b), name
    for name in ("voxel_size", "sform_code", "qform_code", "space_unit", "time_unit",
                 "repetition_time"):  # fmt: skip
        assert getattr(got, name) == getattr(want, name), name


def test_a_cut_plain_nifti_is_refused_as_before(tmp_path) -> None:
    path = tmp_path / "cut.nii"
    _plain(path, random_volume((9, 8, 7), "int16"))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(InputError, match="truncated"):
        open_volume(path)


BLAS_CHECK = (
    "import os, sys\nfrom volconv import cli\n"
    "cli.main = lambda: print(os.environ.get('OPENBLAS_NUM_THREADS'), 'numpy' in sys.modules,"
    " flush=True)\ncli.entry_point()"
)


BLAS_CASES = [({}, "1 False"), ({"OMP_NUM_THREADS": "3"}, "None False"),
              ({"OPENBLAS_NUM_THREADS": "4"}, "4 False")]  # fmt: skip


@pytest.mark.parametrize(("env", "want"), BLAS_CASES)
def test_the_program_asks_for_one_blas_thread_before_numpy_loads(env, want) -> None:
    """OpenBLAS starts its threads as numpy loads: `volconv` asks for one first, unless the
    user set a count."""
    base = {k: v for k, v in os.environ.items() if k not in cli._BLAS_THREADS}
    done = subprocess.run([sys.executable, "-c", BLAS_CHECK], env={**base, **env}, cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.strip() == want, done.stdout + done.stderr


def test_every_user_error_is_a_value_error() -> None:
    """`volconv run` catches the user's mistakes as ValueError and sorts them with
    USER_ERRORS only then, so that the pipeline's modules import after the device's context
    has started: a user error of another kind would end in exit 1, not 2."""
    from volconv.run.jobs import USER_ERRORS

    assert all(issubclass(error, ValueError) for error in USER_ERRORS)


# -- the driver first thing, the programs ahead ------------------------------------------------
DRIVER_FIRST = (
    "import sys\n"
    "from volconv.device import driver\n"
    "driver.start_driver()\n"
    "assert driver._DRIVER and not {'numpy', 'pyopencl'} & set(sys.modules)\n"
    "driver.driver_started()\n"
    "import pyopencl as cl\n"
    "print(len(driver._mapped()), driver.shared_loader() is not None,"
    " sorted(p.name for p in cl.get_platforms()))\n"
)


def test_the_driver_started_before_pyopencl_is_the_one_pyopencl_calls() -> None:
    """`volconv` starts the OpenCL driver before numpy and pyopencl import, through the ICD
    loader pyopencl's wheel bundles: pyopencl then links that one loader (one mapped, a
    context made through it is pyopencl's) and finds the same platforms."""
    if driver._bundled() is None:
        pytest.skip("this pyopencl bundles no ICD loader: the driver starts after it imports")
    done = subprocess.run([sys.executable, "-c", DRIVER_FIRST], capture_output=True, text=True,
                          cwd=ROOT, check=True)  # fmt: skip
    names = sorted(p.name for p in cl.get_platforms())
    assert done.stdout.strip() == f"1 True {names}", done.stderr


def test_the_driver_starts_first_only_for_a_command_on_a_device(monkeypatch) -> None:
    started: list[bool] = []
    monkeypatch.setattr(driver, "start_driver", lambda: started.append(True))
    for argv in (["--help"], ["show", "a.h5"], ["run", "--help"], ["filters"], []):
        cli._start_driver(argv)
    assert started == []
    for argv in (["run", "p.toml"], ["--debug", "validate", "p.toml"], ["devices"]):
        cli._start_driver(argv)
    assert started == [True] * 3


def test_a_program_two_threads_ask_for_is_built_once(device, monkeypatch) -> None:
    """`build` from several threads at once (the programs loading ahead and the run): one
    builds, the others wait for it; a build that fails is not kept, the next one builds."""
    programs.forget_builds()
    ctx, _ = programs.context_for(device)
    calls: list[tuple] = []
    real = programs._build

    def slow(*args: object) -> cl.Program:
        calls.append(args)
        time.sleep(0.3)
        if len(calls) == 1:
            raise cl.Error("the first build fails")
        return real(*args)

    monkeypatch.setattr(programs, "_build", slow)
    defines = (("SRC_T", "uchar"), ("DST_T", "float"))
    with pytest.raises(cl.Error, match="first build"):
        programs.build(ctx, "pad.cl", defines)
    got: list[cl.Program] = []
    threads = [threading.Thread(target=lambda: got.append(programs.build(ctx, "pad.cl", defines)))
               for _ in range(3)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(calls) == 2 and len(got) == 3 and all(g is got[0] for g in got)
    programs.forget_builds()


def recorded_run(tmp_path, monkeypatch) -> tuple[object, cl.Device, list[tuple], np.ndarray]:
    """A run of a small pipeline as a new process makes it, its start recorded in a cache
    folder of the test's own: the config, the device, the programs built (each build of
    this process from here on is added) and the input."""
    from volconv.config import load
    from volconv.run.pipeline import run

    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path / "cache"))
    volume = random_volume((20, 12, 10), "uint8")
    np.save(tmp_path / "scan.npy", volume)
    cfg = load(write_pipeline(tmp_path, BOX, input={"paths": ["scan.npy"]},
                              run={"device": DEVICE}))  # fmt: skip
    built: list[tuple] = []
    real = programs._build
    monkeypatch.setattr(programs, "_build", lambda *a: built.append(a) or real(*a))
    start.forget()
    device = run(cfg, overwrite=True).device
    assert built  # a new process builds (or loads from the binary cache) what it takes
    start.record_programs(device, cfg.source, cfg.text)
    return cfg, device, built, volume


def test_a_run_loads_ahead_the_programs_its_last_run_took(tmp_path, monkeypatch) -> None:
    """A run records the programs it took (per pipeline file and device, in the cache
    folder); the next run's start loads them in the background, so that the run builds none
    itself, with the same output. Without the record it builds them."""
    from volconv.run.pipeline import run

    cfg, device, built, volume = recorded_run(tmp_path, monkeypatch)
    (record,) = (tmp_path / "cache" / "programs").glob("start-*.json")
    assert record.stat().st_mode & 0o077 == 0
    taken, built[:] = list(built), []
    start.forget()
    start.start_programs(device, tmp_path / "another.toml", cfg.text).result(60)
    assert built == []  # another pipeline: no record
    start.start_programs(device, cfg.source, cfg.text + "\n# --set").result(60)
    assert built == []  # the same file with another --set: no record
    start.start_programs(device, cfg.source, cfg.text).result(60)
    assert sorted(map(repr, built)) == sorted(map(repr, taken))  # loaded ahead, in the thread
    (record,) = (tmp_path / "cache" / "programs").glob("start-*.json")
    assert len(json.loads(record.read_text())["page_locked"]) == 1  # one slab: one buffer
    ((ahead,),) = start._LOCKED.values()  # that slab buffer, page-locked ahead
    made = ahead.result(60)
    assert made.dtype == np.float32 and made.shape[0] == len(BOX)
    built.clear()
    run(cfg, overwrite=True)
    assert built == [] and not start._LOCKED  # the run took them
    check_output(tmp_path / "out" / "scan.h5", volume).close()
    start.forget()


def test_page_locked_buffers_made_ahead_are_taken_in_turn_and_others_dropped(device) -> None:
    """`page_locked` takes the buffers made ahead of its shape and type one by one, then
    makes new ones; those of another shape (another pipeline's) go at its first call. What
    it took is what the next run's start makes ahead."""
    start.forget()
    shape, other, f32 = (2, 3, 4, 5), (2, 3, 4, 6), np.dtype(np.float32)

    def ahead(s: tuple[int, ...]) -> np.ndarray:
        made: Future = Future()
        made.set_result(start._page_locked(device, s, f32))
        start._LOCKED.setdefault((device.int_ptr, s, f32.str), []).append(made)
        return made.result()

    first, second, _ = ahead(shape), ahead(shape), ahead(other)
    assert start.page_locked(device, shape, f32) is first
    assert (device.int_ptr, other, f32.str) not in start._LOCKED
    assert start.page_locked(device, shape, f32) is second and not start._LOCKED
    third = start.page_locked(device, shape, f32)
    assert third.shape == shape and third.dtype == f32 and third is not first
    third[...] = 1.5
    assert (third == 1.5).all() and (first is not third)
    assert start._LOCKED_TAKEN[device.int_ptr] == [[list(shape), "<f4"]] * 3
    start.forget()


GOOD = {
    "format": "volconv start 2",
    "programs": [["build", "pad.cl", [["A", 1]], []]],
    "page_locked": [[[2, 3, 4, 5], "<f4"]],
}
BAD = [{"format": "volconv start 1"}, {"programs": [["exec", "pad.cl", [], []]]},
       {"programs": [["build", "../x.cl", [], []]]},
       {"programs": [["build", "pad.cl", [["A", [1]]], []]]},
       {"page_locked": [[[2, -3], "<f4"]]}, {"page_locked": [[[2, 3], "<f8"]]}]  # fmt: skip


def test_a_start_record_another_user_could_have_written_is_not_used(tmp_path, monkeypatch):
    """The start record is under the cache's trust rule: one owned by another user loads
    nothing ahead (one warning names it), and the run builds what it needs."""
    if os.geteuid() != 0:
        pytest.skip("planting a file owned by another user needs root")
    import pwd

    cfg, device, built, _ = recorded_run(tmp_path, monkeypatch)
    (record,) = (tmp_path / "cache" / "programs").glob("start-*.json")
    os.chown(record, pwd.getpwnam("nobody").pw_uid, -1)
    monkeypatch.setattr(cache, "_WARNED", set())
    start.forget()
    built.clear()
    with pytest.warns(RuntimeWarning, match="not this user.*not used"):
        start.start_programs(device, cfg.source, cfg.text).result(60)
    assert built == [] and not start._LOCKED
    start.forget()


@pytest.mark.parametrize("data", [b"", b"not json", *(json.dumps({**GOOD, **d}).encode()
                                                      for d in BAD)])  # fmt: skip
def test_a_start_record_that_is_not_one_names_nothing(data) -> None:
    assert start._started_entries(json.dumps(GOOD).encode()) == (
        [("build", "pad.cl", (("A", 1),), ())],
        [((2, 3, 4, 5), np.dtype(np.float32))],
    )
    assert start._started_entries(data) == ([], [])
