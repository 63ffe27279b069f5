"""A fast start that keeps every safety property: the driver and the context started ahead in
the background, pinned slab buffers made as the run needs them, and a replaced output freed
in the background while the old file stays whole until the new one is complete
(scripts/bench/start.py measures the start)."""

from __future__ import annotations

import subprocess
import sys
import threading

import h5py
import numpy as np
import pyopencl as cl
import pytest
from test_pipeline import ROOT, check_output, random_volume, volconv, write_pipeline

from volconv.device import programs
from volconv.engines.separable import SeparableConvolver
from volconv.run.pipeline import PinnedSlabs

BOX = [{"type": "box"}, {"type": "gaussian", "sigma": 1.0}]


def test_a_context_started_ahead_is_the_one_taken(device, monkeypatch) -> None:
    monkeypatch.setattr(programs, "_MADE", set())  # as in a new process
    programs.start_driver()
    programs.driver_started()
    programs.start_context(device)
    started = programs._CONTEXTS[device.int_ptr]
    ctx, queue = programs.context_for.__wrapped__(device)  # not the process's cached one
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


def test_a_run_imports_only_what_it_needs(tmp_path) -> None:
    """nibabel (0.05-0.1 s) for the files it reads only, the progress bar on a terminal
    only: not for a .npy input written to a pipe."""
    np.save(tmp_path / "scan.npy", random_volume((5, 4, 3), "uint8"))
    pipeline = write_pipeline(tmp_path, BOX)
    code = (
        "import sys; from volconv.cli import main; sys.argv = ['volconv', 'run', sys.argv[1]]\n"
        "try: main()\nexcept SystemExit as e: assert not e.code, e.code\n"
        "print(sorted(m for m in ('nibabel', 'rich.progress', 'scipy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(pipeline)], capture_output=True,
                          text=True, cwd=ROOT, check=True)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
    assert (tmp_path / "out" / "scan.h5").is_file()


def test_every_user_error_is_a_value_error() -> None:
    """`volconv run` catches the user's mistakes as ValueError and sorts them with
    USER_ERRORS only then, so that the pipeline's modules import after the device's context
    has started: a user error of another kind would end in exit 1, not 2."""
    from volconv.run.pipeline import USER_ERRORS

    assert all(issubclass(error, ValueError) for error in USER_ERRORS)
