"""The stored types made on the device (kernels/convert.cl) against the host's `encode`: the
same bytes, the same counts, through every path a slab takes (direct, separable, non-finite
slabs converted on the host), and in a whole run against one converted on the host."""

from __future__ import annotations

import h5py
import numpy as np
import pyopencl as cl
import pytest
from test_pipeline import write_pipeline
from test_writer import attrs

from volconv.config import load
from volconv.device.programs import context_for
from volconv.engines.convert import CALL, DeviceEncoder, device_encodes, encode
from volconv.engines.direct import BankConvolver
from volconv.engines.separable import SeparableConvolver
from volconv.output import ResponseWriter
from volconv.run.jobs import plan_jobs
from volconv.run.pipeline import run

RNG = np.random.default_rng(2026_11_23)
STORED = [("float16", 1.0, 0.0), ("uint8", 1.0, 0.0), ("uint8", 0.37, -12.5), ("uint8", 3.0, 1e3)]


def special_values() -> np.ndarray:
    """Every kind of float32: random bit patterns (NaN payloads, subnormals, huge values),
    values around float16's and uint8's rounding and saturation edges, and normal ones."""
    bits = RNG.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = [65504, 65505, 65519.99, 65520, -65520, 1e9, np.inf, -np.inf, np.nan, -np.nan,
             0.5, 1.5, 2.5, -0.5, -0.0, 254.5, 255.5, 255.49, -1e-40, 1e-45, 6e-8, 3e-8,
             2.98e-8, 6.1e-5, 6.09e-5]  # fmt: skip
    normal = RNG.normal(0, 300, 100_000)
    with np.errstate(invalid="ignore"):
        return np.concatenate([bits, np.array(edges, np.float32), normal.astype(np.float32)])


@pytest.mark.parametrize(("dtype", "scale", "offset"), STORED)
@pytest.mark.parametrize("call", [CALL, 4099], ids=["one-call", "calls"])
def test_device_encoder_makes_the_hosts_bytes_and_counts(device, dtype, scale, offset, call):
    """Every value, and the counts, as the host makes them; in one kernel call or in many
    (what a slab of more than `CALL` values takes)."""
    if not device_encodes(device, dtype):
        pytest.skip(f"{device.name} does not convert {dtype}")
    values = special_values()
    ctx, queue = context_for(device)
    source = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=values)
    encoder = DeviceEncoder(ctx, queue, dtype, len(values) + 100, scale, offset, call)
    want = np.empty(len(values), dtype)
    with np.errstate(all="ignore"):
        nans, clipped = encode(values, want, scale, offset)
    for call in range(2):  # the counts add up over calls
        events, waits = encoder(source, len(values))
        got = np.empty(len(values), dtype)
        cl.enqueue_copy(queue, got, encoder.stored, wait_for=[*events, *waits])
        encoder.add_counts()
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{got.itemsize}"))
        assert (encoder.nans, encoder.clipped) == ((call + 1) * nans, (call + 1) * clipped)
    if dtype == "uint8":
        assert nans > 0 and clipped > 0  # both counted, not zero by accident


def _stored_slabs(conv, volume, dtype, scale, offset):
    """Every slab through ``conv`` as float32 then `encode`, and as the stored type."""
    want, got = np.empty((2, conv.plan.n_filters, *volume.shape), dtype)
    counts = np.zeros(2, np.int64)
    for a, b in conv.slabs():
        rows = volume[conv.source_rows(a, b)]
        counts += encode(conv.convolve_slab(a, b, rows, out=np.empty(
            (conv.plan.n_filters, b - a, *volume.shape[1:]), np.float32)),
            want[:, a:b], scale, offset)  # fmt: skip
    conv.store(dtype, scale, offset)
    for a, b in conv.slabs():
        rows = volume[conv.source_rows(a, b)]
        got[:, a:b] = conv.convolve_slab(a, b, rows)
    return want, got, tuple(counts), conv.counts


@pytest.mark.parametrize(("dtype", "scale", "offset"), STORED[:3])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("engine", ["direct", "separable"])
def test_convolvers_store_the_hosts_bytes(device, dtype, scale, offset, nonfinite, engine):
    """Direct and separable slabs converted on the device; slabs holding NaN or Inf take the
    float32 path, the override and the host's conversion: both as float32 + `encode`."""
    if not device_encodes(device, dtype):
        pytest.skip(f"{device.name} does not convert {dtype}")
    volume = (RNG.standard_normal((13, 9, 10)) * 3e4).astype(np.float32)
    if nonfinite:
        # slab [4, 8) reads no NaN nor Inf: it is converted on the device, the others not
        volume[1, 3, 4], volume[11, 1, 1], volume[12, 8, 9] = np.nan, np.inf, -np.inf
    kernels = RNG.standard_normal((3, 3, 3, 3))
    if engine == "direct":
        conv = BankConvolver(kernels, volume.shape, volume.dtype, "mirror", device=device,
                             slab_depth=4)  # fmt: skip
    else:
        g = np.exp(-0.5 * np.arange(-2, 3) ** 2)
        bank = [np.einsum("i,j,k->ijk", g, g, g), kernels[0], np.einsum("i,j,k->ijk", g, g, -g)]
        conv = SeparableConvolver(bank, volume.shape, volume.dtype, "mirror", device=device,
                                  slab_depth=4)  # fmt: skip
        assert conv.engines == ["separable", "fp32"] or conv.engines == ["separable"]
    want, got, counts, device_counts = _stored_slabs(conv, volume, dtype, scale, offset)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{got.itemsize}"))
    assert device_counts == counts
    if dtype == "uint8":
        assert counts[1] > 0 and (counts[0] > 0) == nonfinite
    assert conv.timings["convert"] > 0


def test_pinned_slabs_take_the_stored_type(device):
    conv = BankConvolver(np.ones((2, 3, 3, 3)), (8, 5, 6), np.uint8, device=device, slab_depth=4)
    assert conv.pinned_slab().dtype == np.float32
    conv.store("float16")
    pinned = conv.pinned_slab()
    assert pinned.dtype == np.float16 and pinned.shape == (2, 4, 5, 6)


@pytest.mark.parametrize(("dtype", "extra"), [("float16", {}), ("uint8", {"scale": 2.0,
                         "offset": -100.0})])  # fmt: skip
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan-inf"])
def test_a_run_stores_what_the_host_conversion_stores(tmp_path, device, dtype, extra, nonfinite):
    """The whole run (device conversion, pinned buffers of the stored type, direct chunks)
    against its float32 output converted by the host's `encode`; the report's counts."""
    volume = (RNG.standard_normal((21, 8, 9)) * 200).astype(np.float32)
    if nonfinite:
        volume[3, 2, 1], volume[15, 0, 0] = np.nan, -np.inf
    np.save(tmp_path / "v.npy", volume)
    filters = [{"type": "gaussian", "sigma": 1.0}, {"type": "sobel", "axis": 1},
               {"type": "log", "sigma": 1.0}]  # fmt: skip
    spec = f"{device.platform.name.strip()}:{device.name.strip()}"
    runs = {}
    for stored in ("float32", dtype):
        (tmp_path / stored).mkdir(exist_ok=True)
        pipeline = write_pipeline(
            tmp_path / stored, filters, input={"paths": [str(tmp_path / "v.npy")]},
            output={"dtype": stored, **(extra if stored == "uint8" else {})},
            run={"device": spec, "slab_depth": 4},
        )  # fmt: skip
        runs[stored] = run(load(pipeline)).reports[0]
        with h5py.File(tmp_path / stored / "out" / "v.h5") as f:
            runs[stored].stored = f["responses"][()]
    exact = runs["float32"].stored
    want = np.empty(exact.shape, dtype)
    nans, clipped = encode(exact, want, **extra)
    got = runs[dtype].stored
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{got.itemsize}"))
    assert runs[dtype].clipped == nans + clipped
    if dtype == "uint8":
        assert clipped > 0 and (nans > 0) == nonfinite
    assert runs[dtype].stages["convert"] > 0 or not device_encodes(device, dtype)


def test_the_writer_stores_converted_slabs_as_they_are(tmp_path):
    """Slabs already of the stored type are written unchanged, their counts recorded."""
    stored = RNG.integers(0, 256, (2, 10, 4, 5), dtype=np.uint8)
    kernels = np.zeros((2, 3, 3, 3))
    with ResponseWriter(tmp_path / "a.h5", (10, 4, 5), ["a", "b"], kernels, dtype="uint8",
                        boundary="reflect", cval=0.0, slab_depth=4) as w:  # fmt: skip
        for a in range(0, 10, 4):
            b = min(a + 4, 10)
            w.write_slab(a, b, stored[:, a:b], counts=(1, a))
        w.drain()
        assert (w.nans, w.clipped) == (3, 12)
        path = w.finish(attrs())
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["responses"][()], stored)


def test_slabs_stored_on_the_device_take_less_host_memory(tmp_path, device):
    """Pinned buffers of the stored type: float16 and uint8 slabs run deeper than float32's
    in the same host_memory, and every plan stays within it."""
    np.save(tmp_path / "v.npy", np.zeros((96, 64, 64), np.uint8))
    spec = f"{device.platform.name.strip()}:{device.name.strip()}"
    bound = 3 * 2**20  # float32: well under the 32 rows a slab streams at most
    depth = {}
    for dtype in ("float32", "float16", "uint8"):
        filters = [{"type": "box"}] + [{"type": "sobel", "axis": a} for a in range(3)]
        pipeline = write_pipeline(tmp_path, filters,
                                  run={"device": spec, "host_memory": bound},
                                  output={"dtype": dtype})  # fmt: skip
        (job,) = plan_jobs(load(pipeline), device)
        assert job.host_bytes <= bound
        depth[dtype] = job.plan.slab_depth
    if device_encodes(device, "uint8"):
        assert depth["float32"] < depth["float16"] < depth["uint8"]


@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32"])
def test_scale_auto_stores_every_response_unsaturated(tmp_path, device, dtype):
    """``scale = "auto"``: one scale and offset per file from the bank's bound over the
    input's range (its type's for integers, its values' for floats; cval with constant),
    so that no voxel saturates, and the stored values decode to scipy's within half a step;
    the file lands under ``{pipeline}``, the pipeline file's name."""
    from scipy import ndimage

    from volconv.checks import spec_tolerance

    if dtype == "float32":
        volume = (RNG.standard_normal((20, 18, 16)) * 50).astype(dtype)
    else:  # the type's whole range, extremes included
        info = np.iinfo(dtype)
        volume = RNG.integers(info.min, info.max, (20, 18, 16), endpoint=True).astype(dtype)
    np.save(tmp_path / "v.npy", volume)
    filters = [{"type": "gaussian", "sigma": 1.0, "order": [1, 0, 0]}, {"type": "box"},
               {"type": "log", "sigma": 1.0}]  # fmt: skip
    spec = f"{device.platform.name.strip()}:{device.name.strip()}"
    pipeline = write_pipeline(tmp_path, filters, bank={"size": 5, "boundary": "constant",
                                                       "cval": -7.0},
                              output={"dtype": "uint8", "scale": "auto",
                                      "path": "out/{pipeline}/{stem}.h5"},
                              run={"device": spec})  # fmt: skip
    cfg = load(pipeline)
    result = run(cfg)
    (report,) = result.reports
    assert report.status == "done" and report.clipped == 0
    with h5py.File(tmp_path / "out" / "pipeline" / "v.h5") as f:
        stored, kernels = f["responses"][()], f["kernels"][()]
        scale, offset = f["responses"].attrs["scale"], f["responses"].attrs["offset"]
    assert scale > 0 and stored.max() <= 255  # one pair: the widest response sets it
    decoded = stored * scale + offset
    for k, kernel in enumerate(kernels):
        ref = ndimage.convolve(volume.astype(np.float64), kernel, mode="constant", cval=-7.0)
        tol = spec_tolerance(kernel, float(np.abs(volume).max()))
        np.testing.assert_array_less(np.abs(decoded[k] - ref), scale / 2 + tol + 1e-6)
    if dtype == "uint8":  # nothing read: the type's range, whatever the values
        kept = np.abs(kernels).sum(axis=(1, 2, 3)).max() * 255
        assert scale * 255 >= kept - 1e-3


def test_scale_auto_gives_each_float_input_its_own_pair(tmp_path, device):
    """Two float inputs of one shape and bank but ranges 100x apart: each file gets its own
    scale (the convolver they share encodes each input with its own), neither saturates."""
    from scipy import ndimage

    volumes = {"small": RNG.standard_normal((16, 12, 10)).astype(np.float32)}
    volumes["large"] = volumes["small"] * 100 + 5
    for name, v in volumes.items():
        np.save(tmp_path / f"{name}.npy", v)
    spec = f"{device.platform.name.strip()}:{device.name.strip()}"
    filters = [{"type": "gaussian", "sigma": 1.0, "order": [0, 1, 0]}]
    pipeline = write_pipeline(tmp_path, filters, output={"dtype": "uint8", "scale": "auto"},
                              run={"device": spec})  # fmt: skip
    result = run(load(pipeline))
    assert [r.clipped for r in result.reports] == [0, 0]
    scales = {}
    for name, v in volumes.items():
        with h5py.File(tmp_path / "out" / f"{name}.h5") as f:
            stored, kernel = f["responses"][0], f["kernels"][0]
            scale, offset = f["responses"].attrs["scale"], f["responses"].attrs["offset"]
        ref = ndimage.convolve(v.astype(np.float64), kernel, mode="reflect")
        np.testing.assert_array_less(np.abs(stored * scale + offset - ref), scale * 0.5 + 1e-3)
        scales[name] = scale
    assert scales["large"] == pytest.approx(100 * scales["small"], rel=1e-3)
