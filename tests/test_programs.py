"""volconv.programs: CPU program binaries cached on disk, built again when refused."""

from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from volconv import programs
from volconv.programs import context_for, cpu_binary_build, kernel_source

OPTIONS = ["-DVW=4", "-DCHAINS=2", "-DBLOCK=2"]


@pytest.fixture
def cpu(device):
    if not device.type & cl.device_type.CPU:
        pytest.skip("the binary cache is the CPU build path")
    return device


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


def test_second_build_loads_the_binary(cpu, tmp_path, monkeypatch):
    ctx, _ = context_for(cpu)
    built = sources_built(monkeypatch)
    first = cpu_binary_build(ctx, cpu, kernel_source("fma_probe.cl"), OPTIONS, tmp_path)
    (path,) = (tmp_path / "programs").iterdir()
    assert built == ["source"] and path.suffix == ".bin" and path.stat().st_size > 0
    second = cpu_binary_build(ctx, cpu, kernel_source("fma_probe.cl"), OPTIONS, tmp_path)
    assert built == ["source"]  # from the binary
    np.testing.assert_array_equal(probe(second, cpu), probe(first, cpu))
    # other options are another program
    cpu_binary_build(ctx, cpu, kernel_source("fma_probe.cl"), ["-DVW=2"], tmp_path)
    assert built == ["source", "source"] and len(list((tmp_path / "programs").iterdir())) == 2


def test_a_refused_binary_is_built_again_and_replaced(cpu, tmp_path, monkeypatch):
    ctx, _ = context_for(cpu)
    cpu_binary_build(ctx, cpu, kernel_source("fma_probe.cl"), OPTIONS, tmp_path)
    (path,) = (tmp_path / "programs").iterdir()
    path.write_bytes(b"not a binary")
    built = sources_built(monkeypatch)
    program = cpu_binary_build(ctx, cpu, kernel_source("fma_probe.cl"), OPTIONS, tmp_path)
    assert built == ["source"] and path.read_bytes() != b"not a binary"
    assert np.all(np.isfinite(probe(program, cpu)))
    assert [p.name for p in (tmp_path / "programs").iterdir()] == [path.name]  # no temp left
