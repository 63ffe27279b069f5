"""volconv.device.programs: the one build path, with program binaries cached on disk for every kind
of device; a miss builds from source (and says so once), a stale, damaged or refused entry is
built again and replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pyopencl as cl
import pytest

from volconv.device import cache, programs
from volconv.device.programs import (
    PROGRAM_MAGIC,
    binary_build,
    build,
    context_for,
    kernel_source,
    pack_program,
    program_digest,
)

OPTIONS = ["-DVW=4", "-DCHAINS=2", "-DBLOCK=2"]


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """A process as new: nothing warned or announced yet; the per-user cache folder in the
    test's own folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(cache, "_WARNED", set())
    monkeypatch.setattr(programs, "_BUILT", [])


def probe(program: cl.Program, device: cl.Device) -> np.ndarray:
    """The FMA probe's output for 8 work-items, 3 iterations: the program runs."""
    ctx, queue = context_for(device)
    out = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, 8 * 4)
    knl = cl.Kernel(program, "fma_probe")
    knl(queue, (8,), None, out, np.int32(3), np.float32(0.5), np.float32(1.0))
    host = np.empty(8, np.float32)
    cl.enqueue_copy(queue, host, out)
    return host


def sources_built(monkeypatch) -> list[str]:
    """Record every program built from source (a str) rather than from binaries."""
    built = []
    real = cl.Program

    def program(ctx, *args):
        if len(args) == 1 and isinstance(args[0], str):
            built.append("source")
        return real(ctx, *args)

    monkeypatch.setattr(programs.cl, "Program", program)
    return built


def fma(device, folder):
    ctx, _ = context_for(device)
    return binary_build(ctx, kernel_source("fma_probe.cl"), OPTIONS, cache_dir=folder)


def test_second_build_loads_the_binary(device, tmp_path, monkeypatch, capsys):
    """On every device kind: a miss builds from source, says so once, and caches the binary
    under programs/ (private); a hit loads it and gives the same results."""
    ctx, _ = context_for(device)
    built = sources_built(monkeypatch)
    first = fma(device, tmp_path)
    (path,) = (tmp_path / "programs").iterdir()
    assert built == ["source"] and path.suffix == ".bin"
    assert path.read_bytes().startswith(PROGRAM_MAGIC)
    assert path.stat().st_mode & 0o077 == 0 and (tmp_path / "programs").stat().st_mode & 0o077 == 0
    said = capsys.readouterr().err
    assert said.count("volconv: building kernels for") == 1
    assert device.name.strip() in said and str(tmp_path / "programs") in said
    second = fma(device, tmp_path)
    assert built == ["source"]  # from the binary
    np.testing.assert_array_equal(probe(second, device), probe(first, device))
    # other options are another program, built (and not announced again)
    binary_build(ctx, kernel_source("fma_probe.cl"), ["-DVW=2"], cache_dir=tmp_path)
    assert built == ["source", "source"] and len(list((tmp_path / "programs").iterdir())) == 2
    assert "building kernels" not in capsys.readouterr().err


def test_build_goes_through_the_cache(device, tmp_path, monkeypatch):
    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path))
    ctx, _ = context_for(device)
    defines = (("VW", 2), ("CHAINS", 3), ("BLOCK", 5))
    build(ctx, "fma_probe.cl", defines)
    digest = program_digest(device, kernel_source("fma_probe.cl"), ["-DVW=2", "-DCHAINS=3",
                                                                     "-DBLOCK=5"])  # fmt: skip
    assert (tmp_path / "programs" / f"{digest[:32]}.bin").is_file()


def test_a_refused_binary_is_built_again_and_replaced(device, tmp_path, monkeypatch):
    fma(device, tmp_path)
    (path,) = (tmp_path / "programs").iterdir()
    digest = program_digest(device, kernel_source("fma_probe.cl"), OPTIONS)
    path.write_bytes(pack_program(digest, b"not a binary", OPTIONS))  # a valid header
    built = sources_built(monkeypatch)
    program = fma(device, tmp_path)
    assert built == ["source"] and b"not a binary" not in path.read_bytes()
    assert np.all(np.isfinite(probe(program, device)))
    assert [p.name for p in (tmp_path / "programs").iterdir()] == [path.name]  # no temp left


@pytest.mark.parametrize("entry", ["stale", "damaged", "old", "header"])
def test_a_stale_or_damaged_entry_is_refused(device, tmp_path, monkeypatch, entry):
    """An entry whose digest is another build's (copied or renamed), whose binary does not
    match its SHA-256, or that is not a volconv entry is never loaded: built again, replaced."""
    ctx, _ = context_for(device)
    source = kernel_source("fma_probe.cl")
    other = binary_build(ctx, source, ["-DVW=2", "-DCHAINS=2", "-DBLOCK=2"], cache_dir=tmp_path)
    binary = other.get_info(cl.program_info.BINARIES)[0]
    digest = program_digest(device, source, OPTIONS)
    path = tmp_path / "programs" / f"{digest[:32]}.bin"
    path.write_bytes({
        "stale": pack_program(digest[::-1], binary, OPTIONS),
        "damaged": pack_program(digest, binary, OPTIONS)[:-1] + bytes([binary[-1] ^ 0xFF]),
        "old": binary,
        "header": PROGRAM_MAGIC + b"{not json\n" + binary,
    }[entry])  # fmt: skip
    built = sources_built(monkeypatch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        program = fma(device, tmp_path)
    assert built == ["source"]
    # the right program ran: VW=4 writes what a fresh build of the same options writes
    fresh = cl.Program(ctx, source).build(options=OPTIONS)
    np.testing.assert_array_equal(probe(program, device), probe(fresh, device))
    header = json.loads(path.read_bytes()[len(PROGRAM_MAGIC) :].split(b"\n", 1)[0])
    assert header["digest"] == digest
    said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    if entry == "old":  # an older volconv's entry: replaced quietly
        assert not said
    else:  # the others: one warning naming the entry
        assert len(said) == 1 and str(path) in said[0], said


def test_compiler_output_does_not_reach_the_user(device, tmp_path):
    """pyopencl's CompilerWarning on a non-empty build log is filtered where volconv builds,
    not globally: the same build outside volconv still warns."""
    ctx, _ = context_for(device)
    source = "#warning volconv test\n__kernel void k(__global float *a) { a[0] = 1.0f; }\n"
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        cl.Program(ctx, source).build()
    if not any(issubclass(w.category, cl.CompilerWarning) for w in outside):
        pytest.skip(f"{device.name.strip()} leaves no build log for #warning")
    with warnings.catch_warnings(record=True) as inside:
        warnings.simplefilter("always")
        binary_build(ctx, source, [], cache_dir=tmp_path)
    assert not [w for w in inside if issubclass(w.category, cl.CompilerWarning)]


def test_an_unwritable_cache_still_builds(device):
    """A cache folder that cannot be made: built from source, nothing cached, nothing said."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = fma(device, Path("/proc/self/volconv-cache"))
    assert np.all(np.isfinite(probe(program, device)))


def test_a_first_run_says_it_builds_once_and_a_second_loads(tmp_path):
    """`volconv run` on a cold cache: one line on stderr naming the device and the cache, no
    compiler output; the same run again loads every program and says nothing."""
    from test_pipeline import ROOT, check_output, random_volume, write_pipeline

    volume = random_volume((9, 8, 7), "uint8")
    np.save(tmp_path / "scan.npy", volume)
    pipeline = write_pipeline(tmp_path, [{"type": "box"}])
    env = {**os.environ, "VOLCONV_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "volconv", "run", str(pipeline), "--overwrite"]
    said = []
    for _ in range(2):
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        check_output(tmp_path / "out" / "scan.h5", volume).close()
        said.append(done.stderr)
    (line,) = said[0].splitlines()
    assert line.startswith("volconv: building kernels for ") and ", once; " in line
    assert line.endswith(f"later runs load them from {tmp_path / 'cache' / 'programs'}")
    assert said[1] == ""
