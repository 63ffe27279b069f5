"""volconv.config: the pipeline file, ``--set`` and the one place a pipeline is validated."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from test_pipeline import PIPELINES, write_pipeline

from volconv.config import PipelineError, dump_toml, load, parse_set


def test_set_values_are_toml_else_text():
    assert parse_set("bank.size=[3, 5, 7]") == (["bank", "size"], [3, 5, 7])
    assert parse_set("bank.cval=-1.5") == (["bank", "cval"], -1.5)
    assert parse_set("run.device=0:1") == (["run", "device"], "0:1")
    assert parse_set("bank.filter[2].sigma=2") == (["bank", "filter", 2, "sigma"], 2)


def test_set_paths_are_relative_to_the_working_directory():
    cwd = Path.cwd()
    assert parse_set("input.paths=scans/*.nii.gz") == (["input", "paths"], f"{cwd}/scans/*.nii.gz")
    assert parse_set('input.paths=["a.npy", "/b.npy"]')[1] == [f"{cwd}/a.npy", "/b.npy"]
    assert parse_set('output.path="/abs/{stem}.h5"') == (["output", "path"], "/abs/{stem}.h5")
    out = f"{cwd}/x = {{stem}}.h5"
    assert parse_set('output.path="x = {stem}.h5"') == (["output", "path"], out)
    assert parse_set("bank.filter[0].path=k.npy")[1] == f"{cwd}/k.npy"
    assert parse_set("run.device=cpu")[1] == "cpu"  # not a path


def test_dump_toml_round_trips_every_example():
    for path in PIPELINES:
        data = tomllib.loads(path.read_text())
        assert tomllib.loads(dump_toml(data)) == data, path
    odd = {"a": {"k y": 'q"\\\n', "n": [1.5, float("inf")], "t": {"x": True}}, "b": {"c": []}}
    assert tomllib.loads(dump_toml(odd)) == odd


def test_relative_paths_and_overrides(tmp_path):
    (tmp_path / "sub").mkdir()
    pipeline = write_pipeline(tmp_path / "sub", [{"type": "box"}, {"type": "box", "size": 5}])
    cfg = load(pipeline, ["bank.filter[1].size=3", "bank.filter[0].name=first", "run.slab_depth=4"])
    assert cfg.base_dir == (tmp_path / "sub").resolve()
    assert cfg.filters[1]["size"] == 3 and cfg.filters[0]["name"] == "first"
    assert cfg.slab_depth == 4
    assert tomllib.loads(cfg.text)["bank"]["filter"][1]["size"] == 3
    assert load(pipeline, device="cpu").device == "cpu"


def test_bank_units_is_the_default_of_its_filters(tmp_path):
    filters = [{"type": "gaussian", "sigma": 2.0}, {"type": "box"}]
    cfg = load(write_pipeline(tmp_path, filters, bank={"units": "mm"}))
    assert cfg.units == "mm"
    with pytest.raises(PipelineError, match=r"bank.units = 'cm' is not one of voxels, mm"):
        load(write_pipeline(tmp_path, filters, bank={"units": "cm"}))
    with pytest.raises(PipelineError, match=r"unknown key bank.unit \(did you mean bank.units\?\)"):
        load(write_pipeline(tmp_path, filters, bank={"unit": "mm"}))


@pytest.mark.parametrize(
    ("section", "body", "words"),
    [
        ("bank", {"boundary": "reflekt"}, "bank.boundary must be one of"),
        ("bank", {"boundary": "reflekt"}, "did you mean 'reflect'?"),
        (
            "output",
            {"dtype": "int8"},
            "output.dtype = 'int8' is not one of float32, float16, uint8",
        ),
        ("run", {"slab_depth": 0}, "run.slab_depth must be a positive integer"),
        ("run", {"slab_depth": True}, "run.slab_depth must be a positive integer"),
        ("run", {"devise": "cpu"}, "did you mean run.device?"),
        # finite, but beyond float32, which volconv computes in: inf, or a division by 0
        ("bank", {"cval": 1e308}, "bank.cval must be within float32's range"),
        ("output", {"dtype": "uint8", "scale": 1e-300}, "output.scale must be within float32"),
        ("output", {"dtype": "uint8", "scale": -1e39}, "output.scale must be within float32"),
        ("output", {"dtype": "uint8", "offset": 1e308}, "output.offset must be within float32"),
    ],
)
def test_mistakes_name_the_key(tmp_path, section, body, words):
    with pytest.raises(PipelineError, match=None) as e:
        load(write_pipeline(tmp_path, [{"type": "box"}], **{section: body}))
    assert words in str(e.value) and str(tmp_path) in str(e.value)


def test_a_byte_order_mark_is_not_an_error(tmp_path):
    """Editors on Windows start UTF-8 files with a BOM; tomllib alone rejects it."""
    plain = write_pipeline(tmp_path, [{"type": "box"}])
    marked = tmp_path / "bom.toml"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads(marked.read_text(encoding="utf-8"))
    assert load(marked).filters == load(plain).filters


def test_host_memory_takes_any_size_bounded_by_the_machine(tmp_path):
    """ "1PiB" is a size; the bound is then all the memory this machine has."""
    from volconv.config import machine_memory

    cfg = load(write_pipeline(tmp_path, [{"type": "box"}], run={"host_memory": "1PiB"}))
    assert cfg.host_memory == min(2**50, machine_memory()) and cfg.host_memory > 2**20
    assert load(write_pipeline(tmp_path, [{"type": "box"}], run={"host_memory": "3MiB"})
                ).host_memory == 3 * 2**20  # fmt: skip
    with pytest.raises(PipelineError, match=r"run.host_memory must be a size .*EiB"):
        load(write_pipeline(tmp_path, [{"type": "box"}], run={"host_memory": "1QiB"}))


def test_output_paths_take_the_pipeline_files_name(tmp_path):
    cfg = load(write_pipeline(tmp_path, [{"type": "box"}],
                              output={"path": "out/{pipeline}/{parent}-{stem}.h5"}))  # fmt: skip
    assert cfg.output == "out/{pipeline}/{parent}-{stem}.h5"
    with pytest.raises(PipelineError, match=r"unknown field \{pipe\}.*\{pipeline\}"):
        load(write_pipeline(tmp_path, [{"type": "box"}], output={"path": "{pipe}.h5"}))


@pytest.mark.parametrize(
    ("section", "body", "words"),
    [
        ("input", {"external": "yes"}, "input.external must be true or false"),
        ("output", {"dtype": "uint8", "scale": "auto", "offset": 3}, "remove output.offset"),
        ("output", {"scale": "auto"}, 'output.scale applies to dtype = "uint8" only'),
        ("output", {"dtype": "uint8", "scale": "automatic"}, 'non-zero number or "auto"'),
    ],
)
def test_new_keys_name_their_mistakes(tmp_path, section, body, words):
    with pytest.raises(PipelineError) as e:
        load(write_pipeline(tmp_path, [{"type": "box"}], **{section: body}))
    assert words in str(e.value)


def test_external_and_scale_auto_are_read(tmp_path):
    cfg = load(write_pipeline(tmp_path, [{"type": "box"}], input={"external": True},
                              output={"dtype": "uint8", "scale": "auto"}))  # fmt: skip
    assert cfg.external and cfg.scale_auto
    assert not load(write_pipeline(tmp_path, [{"type": "box"}])).external
