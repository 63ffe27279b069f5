"""The memory model of the presets' stage (`volconv.engines.scales.PresetStage`): what it
allocates on the host and the device at a slab depth (`preset_bytes`, which a pipeline's memory
plan counts), and the choices both depend on: stage 1's filters and smoother, the rows stage 2
reads past a slab."""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from volconv.bank.features import gaussian_filter_of
from volconv.bank.presets import PresetPlan
from volconv.engines.features import lanes_for
from volconv.engines.gaussians import RowGaussians, row_gaussians_bytes
from volconv.engines.smoothing import NearestGaussians, nearest_gaussians_bytes

SUB_ROWS = 32  # output rows stage 2 writes at a time (its output buffer's depth)
SLACK = 32  # floats before and after ilastik's V (kernels/stencils.cl's SLACK)


def smoothing_filters(preset: PresetPlan) -> list:
    """ilastik's stage 1's filters: every scale's Gaussian."""
    return [gaussian_filter_of(f"smooth{i}", (s.smooth,) * 3, (0, 0, 0), s.truncate)
            for i, s in enumerate(preset.scales)]  # fmt: skip


def reach(preset: PresetPlan) -> int:
    """Rows of stage 1 past a slab: np.gradient twice (skimage), the inner radius 2 and the
    outer 1 (ilastik)."""
    return 2 if preset.kind == "skimage" else 3


def buffer_bytes(
    preset: PresetPlan, shape: tuple[int, int, int], depth: int, device: cl.Device
) -> int:
    """The stage's own device buffers: stage 1's field (ilastik: a copy, wrap's two runs),
    the passes over the product rows (ilastik; wrap's two runs) and stage 2's outputs."""
    n0, ny, nz = shape
    sub = min(depth, SUB_ROWS)
    rows = min(n0, depth + 2 * reach(preset))
    own = preset.n_outputs * sub * ny * nz
    vectors = lanes_for(device) > 1  # kernels/skimage_rows.cl, ilastik_rows.cl
    own += 0 if vectors else 1  # GPUs: kernels/stencils.cl's E (not written)
    if preset.kind == "ilastik":
        q = 2 * (sub + 2)
        own += 2 * rows * len(preset.scales) * ny * nz  # field
        if vectors:
            own += 6 * q * ny * nz + nz  # T, a row of cval
        else:
            own += (q + sub) * 6 * ny * nz + 2 * SLACK  # T, V
    return own * 4


def preset_bytes(
    preset: PresetPlan, shape: tuple[int, int, int], dtype: np.dtype, mode: str, cval: float,
    device: cl.Device, depth: int,
) -> tuple[int, int]:  # fmt: skip
    """The memory a `PresetStage` takes at slab depth ``depth``, as ``(host, device)``: on the
    host the outputs of a slab and stage 1's field of a slab holding NaN or Inf; on the device
    stage 1's convolver (`make_separable_plan`), its field, the gradients and stage 2's
    outputs."""
    from volconv.plan.separable import make_separable_plan, plan_bank

    n0, ny, nz = shape
    filters = smoothing_filters(preset)
    rows = min(n0, depth + 2 * reach(preset))
    own = buffer_bytes(preset, shape, depth, device)
    if preset.kind == "skimage":  # the outputs of a slab, the input rows it reads
        host = preset.n_outputs * depth * ny * nz * 4 + (rows + 2 * skimage_reach(preset)) * (
            ny * nz * np.dtype(dtype).itemsize
        )
        radii = skimage_radii(preset)
        if skimage_smoother(device) is RowGaussians:  # and the input rows in float32
            host += min(n0, rows + 2 * skimage_reach(preset)) * ny * nz * 4
            return host, own + row_gaussians_bytes(radii, shape, rows)
        return host, own + nearest_gaussians_bytes(radii, shape, dtype, rows)
    plan = make_separable_plan(
        filters, shape, dtype, mode, cval, device, choices=plan_bank(filters, force="separable"),
        slab_depth=rows, fused=False,
    )  # fmt: skip
    host = (preset.n_outputs * depth + len(filters) * rows) * ny * nz * 4
    return host, plan.device_bytes + own


def skimage_smoother(device: cl.Device) -> type:
    """skimage's stage 1: `RowGaussians` on CPUs (vectors along axis 2, no padded rows),
    `NearestGaussians` on GPUs (rows kept between slabs)."""
    return RowGaussians if device.type & cl.device_type.CPU else NearestGaussians


def skimage_radii(preset: PresetPlan) -> list[int]:
    """The radii of skimage's Gaussians."""
    return [s.smooth_radius for s in preset.scales]


def skimage_reach(preset: PresetPlan) -> int:
    """Input rows skimage's widest Gaussian reads past its field's."""
    return max(skimage_radii(preset))
