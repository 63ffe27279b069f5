"""The peers `volconv bench` times on the same work as volconv: scipy.ndimage.convolve on the
CPU (on a smaller volume: it is slow), and, when importable, torch.nn.functional.conv3d and
cupyx.scipy.ndimage.convolve on a GPU, each checked against volconv's own responses.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from volconv.checks import spec_tolerance
from volconv.device.peak import cpuinfo
from volconv.engines.boundary import extend_indices, halo

if TYPE_CHECKING:
    from volconv.bench import Work


def padded_volume(volume: np.ndarray, extent: Sequence[int], mode: str, cval: float) -> np.ndarray:
    """``volume`` extended as scipy.ndimage.convolve extends it, float32.

    A "valid" correlation of the result with the flipped kernel (what conv3d computes) is
    scipy's convolve of ``volume``; the same index maps as volconv's own padding.
    """
    maps = [
        extend_indices(s, -halo(k)[0], s + halo(k)[1], mode)
        for s, k in zip(volume.shape, extent, strict=True)
    ]
    out = volume.astype(np.float32)[np.ix_(*(np.maximum(m, 0) for m in maps))]
    if mode == "constant":
        m0, m1, m2 = (m < 0 for m in maps)
        out[m0[:, None, None] | m1[None, :, None] | m2[None, None, :]] = cval
    return out


def _median_seconds(call: Callable[[], object], repeats: int, timed: Callable[[], float]) -> float:
    """Median seconds of ``call`` after one warm-up; ``timed`` times one call (GPU events)."""
    call()
    return float(np.median([timed() for _ in range(repeats)]))


def _error_ratio(
    out: np.ndarray, ref: np.ndarray, volume: np.ndarray, kernels: np.ndarray
) -> float:
    """Worst |out - ref| over the contract's tolerance across filters: <= 1 agrees, as volconv's
    own responses (``ref``) agree with scipy's."""
    vmax = float(np.max(np.abs(volume)))
    worst = 0.0
    for f, k in enumerate(kernels):
        tol = spec_tolerance(k, vmax)
        worst = max(worst, float(np.max(np.abs(out[f].astype(np.float64) - ref[f]))) / tol)
    return worst


def peer_scipy(work: Work, size: int, repeats: int) -> dict[str, object]:
    """scipy.ndimage.convolve, one filter after another, on a ``size``-voxel cube (float32)."""
    import scipy.ndimage as ndi

    shape = tuple(min(s, size) for s in work.shape)
    v = work.volume(shape).astype(np.float32)
    kernels = work.kernels().astype(np.float32)

    def call() -> None:
        for k in kernels:
            ndi.convolve(v, k, mode=work.mode, cval=work.cval)

    def timed() -> float:
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    seconds = _median_seconds(call, repeats, timed)
    gflop = work.gflop(shape=shape)
    return {
        "name": "scipy.ndimage.convolve",
        "device": f"{cpuinfo().name or platform.machine()}, one thread",
        "shape": list(shape),
        "seconds": seconds,
        "gflop": gflop,
        "gflops": gflop / seconds,
        "note": f"timed on {'x'.join(map(str, shape))} (scipy is slow); rates compared",
    }


def peer_torch(
    work: Work, volume: np.ndarray, rows: tuple[int, int], ref: np.ndarray, repeats: int
) -> dict[str, object]:
    """torch.nn.functional.conv3d in FP32 (TF32 off) on the padded volume, flipped kernels."""
    import torch
    import torch.nn.functional as F

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    torch.backends.cudnn.allow_tf32 = False  # FP32 like volconv, not tensor-core TF32
    torch.backends.cudnn.benchmark = True  # the warm-up lets cuDNN pick its fastest algorithm
    kernels = work.kernels()
    x = torch.from_numpy(padded_volume(volume, work.extent, work.mode, work.cval)).to(dev)
    x = x[None, None]
    # conv3d correlates: flipping every axis makes it scipy's convolution
    w = torch.from_numpy(np.ascontiguousarray(kernels[:, None, ::-1, ::-1, ::-1], np.float32))
    w = w.to(dev)

    def call():
        return F.conv3d(x, w)

    def timed() -> float:
        if not cuda:
            t0 = time.perf_counter()
            call()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    with torch.no_grad():
        seconds = _median_seconds(call, repeats, timed)
        out = call()[0, :, rows[0] : rows[1]].cpu().numpy()
    gflop = work.gflop()
    return {
        "name": "torch.nn.functional.conv3d",
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "version": torch.__version__,
        "shape": list(work.shape),
        "seconds": seconds,
        "gflop": gflop,
        "gflops": gflop / seconds,
        "diff_vs_volconv": _error_ratio(out, ref, volume, kernels),
        "note": "FP32 (TF32 off), cudnn.benchmark; input padded and converted beforehand",
    }


def peer_cupy(
    work: Work, volume: np.ndarray, rows: tuple[int, int], ref: np.ndarray, repeats: int
) -> dict[str, object]:
    """cupyx.scipy.ndimage.convolve, one filter after another, on the float32 volume."""
    import cupy
    from cupyx.scipy import ndimage as cndi

    kernels = work.kernels()
    v = cupy.asarray(volume.astype(np.float32))
    ks = [cupy.asarray(k.astype(np.float32)) for k in kernels]

    def call():
        return [cndi.convolve(v, k, mode=work.mode, cval=work.cval) for k in ks]

    def timed() -> float:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        call()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3

    seconds = _median_seconds(call, repeats, timed)
    out = np.stack([r[rows[0] : rows[1]].get() for r in call()])
    gflop = work.gflop()
    return {
        "name": "cupyx.scipy.ndimage.convolve",
        "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "version": cupy.__version__,
        "shape": list(work.shape),
        "seconds": seconds,
        "gflop": gflop,
        "gflops": gflop / seconds,
        "diff_vs_volconv": _error_ratio(out, ref, volume, kernels),
        "note": "float32 input, one call per filter",
    }


def run_peers(
    work: Work,
    volume: np.ndarray,
    rows: tuple[int, int],
    responses: np.ndarray,
    volconv_gflops: float,
    *,
    repeats: int,
    scipy_size: int,
) -> list[dict[str, object]]:
    """Every peer that can run here, with its rate and volconv's rate over it."""
    # volconv's responses, which agree with scipy (the engine's tests), check that the GPU
    # peers did the same work: scipy itself on the full volume would take minutes
    found = []
    for name, run in (
        ("scipy.ndimage.convolve", lambda: peer_scipy(work, scipy_size, min(repeats, 3))),
        ("torch.nn.functional.conv3d", lambda: peer_torch(work, volume, rows, responses, repeats)),
        ("cupyx.scipy.ndimage.convolve", lambda: peer_cupy(work, volume, rows, responses, repeats)),
    ):
        try:
            peer = run()
        except ImportError as e:
            found.append({"name": name, "skipped": f"not importable: {e}"})
            continue
        except Exception as e:  # a peer's own failure (no GPU, out of memory): say, go on
            found.append({"name": name, "error": f"{type(e).__name__}: {e}"})
            continue
        peer["ratio"] = volconv_gflops / peer["gflops"]
        found.append(peer)
    return found
