"""`volconv show`: a readable picture of every response of an output, whatever the bank's size:
a grid within a bounded size whose title covers no slice, the frame of a 4D output named, and
slices drawn at the voxel size's aspect."""

from __future__ import annotations

import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest
from test_pipeline import random_volume, volconv, write_pipeline

from volconv.output import read
from volconv.show import MAX_PIXELS, central_slices, figure, grid, slice_aspects


def _bank(n: int) -> list[dict]:
    return [{"name": f"g{i}", "type": "gaussian", "sigma": 0.6 + 0.05 * i,
             "order": [i % 3, 0, 0]} for i in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, object]:
    """48- and 4-filter outputs of a 4D NIfTI with voxels of 1 x 2 x 3 mm, a 4-filter 3D one."""
    folder = tmp_path_factory.mktemp("show")
    volume = random_volume((14, 12, 10, 3), "uint8")
    nib.save(nib.Nifti1Image(volume, np.diag([1.0, 2.0, 3.0, 1.0])), folder / "t.nii")
    np.save(folder / "s.npy", random_volume((10, 9, 8), "uint8"))
    made = {}
    for name, n in (("t.nii", 48), ("t.nii", 4), ("s.npy", 4)):
        pipeline = write_pipeline(folder, _bank(n), input={"paths": [name]},
                                  output={"path": f"out/{{stem}}{n}.h5"})  # fmt: skip
        code = _run(pipeline)
        assert code == 0
        made[f"{name.split('.')[0]}{n}"] = folder / "out" / f"{name.split('.')[0]}{n}.h5"
    made["volume"] = volume
    return made


def _run(pipeline) -> int:
    return subprocess.run([sys.executable, "-m", "volconv", "run", str(pipeline)],
                          capture_output=True, timeout=300).returncode  # fmt: skip


def test_48_responses_make_a_bounded_grid_titled_above_it(outputs):
    rows, groups = grid(48)
    assert (rows, groups) == (12, 4)
    output = outputs["t48"]
    with read(output) as f:
        fig = figure(f, output.name)
        fig.canvas.draw()  # as show() saves it, at its DPI
        width, height = fig.canvas.get_width_height()
        assert height <= MAX_PIXELS and width <= MAX_PIXELS  # was 600 x 8880
        assert width >= 3 * 4 * 100  # four groups of three slices across, each readable
        renderer = fig.canvas.get_renderer()
        title = fig._suptitle.get_window_extent(renderer)
        drawn = [ax for ax in fig.axes if ax.axison]
        assert len(drawn) == 3 * 48
        for ax in drawn:  # no slice and no filter's title under the figure's title
            assert not title.overlaps(ax.get_window_extent(renderer))
            if ax.title.get_text():
                assert not title.overlaps(ax.title.get_window_extent(renderer))
        names = [ax.title.get_text().split(":")[0] for ax in drawn if ax.title.get_text()]
        assert sorted(names) == sorted(f"g{i}" for i in range(48))


def test_a_4d_output_says_which_frame(outputs, tmp_path, capsys):
    output = outputs["t4"]
    with read(output) as f:
        assert figure(f, output.name)._suptitle.get_text().endswith("frame 1 of 3")  # middle
        fig = figure(f, output.name, frame=2)
        assert fig._suptitle.get_text().endswith("frame 2 of 3")
        # the frame drawn is the one named: the slices of frame 2, decoded
        planes = central_slices(f, 0, frame=2)
        np.testing.assert_array_equal(planes[0], np.asarray(f.outputs[0])[7, :, :, 2])
    code, _, err = volconv("show", output, "--frame", "3", "--png", tmp_path / "x.png",
                             capsys=capsys)  # fmt: skip
    assert code == 2 and "--frame 3" in err and "3 frames (0..2)" in err
    code, _, err = volconv("show", outputs["s4"], "--frame", "0", "--png",
                             tmp_path / "y.png", capsys=capsys)  # fmt: skip
    assert code == 2 and "is 3D" in err
    with read(outputs["s4"]) as f:
        assert "frame" not in figure(f, "s.h5")._suptitle.get_text()


def test_slices_keep_the_voxel_size_aspect(outputs):
    with read(outputs["t4"]) as f:
        np.testing.assert_allclose(f.voxel_size[:3], [1.0, 2.0, 3.0])
        fig = figure(f, "t.h5")
        drawn = [ax for ax in fig.axes if ax.axison]
        # x slice: y across, z up (3/2); y slice: x across, z up (3/1); z slice: y up (2/1)
        assert [ax.get_aspect() for ax in drawn[:3]] == pytest.approx([1.5, 3.0, 2.0])
    assert slice_aspects([2.0, 2.0, 2.0]) == (1.0, 1.0, 1.0)
    assert slice_aspects(None) == slice_aspects([0.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("suffix", [".nii.gz", ".zarr"])
def test_show_reads_every_format(tmp_path, capsys, suffix):
    if suffix == ".zarr":
        pytest.importorskip("zarr")
    np.save(tmp_path / "s.npy", random_volume((10, 9, 8), "uint8"))
    pipeline = write_pipeline(tmp_path, _bank(2), input={"paths": ["s.npy"]},
                              output={"path": f"out/{{stem}}{suffix}"})  # fmt: skip
    assert _run(pipeline) == 0
    output = tmp_path / "out" / f"s{suffix}"
    code, _, err = volconv("show", output, "--png", tmp_path / "s.png", capsys=capsys)
    assert code == 0, err
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with read(output) as f:
        assert figure(f, output.name)._suptitle.get_text().startswith(f"s{suffix}")
