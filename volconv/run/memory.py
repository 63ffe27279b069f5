"""The memory a run holds, host and device (contract, "Memory"): what `plan_jobs` sizes each
job's slab depth to (`fit_host_memory`) and what a batch sizes its workers by
(`Job.host_bytes`, `Job.device_bytes`). A new buffer of the run is counted here:
`host_bytes` on the host, `device_bytes` on the device (`tensor_bytes`, `nonfinite_bytes`
for the features' and the non-finite override's)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import pyopencl as cl

from volconv.bank.filters import stack_kernels
from volconv.bank.spec import MAX_EXTENT
from volconv.config import Config, PipelineError
from volconv.engines.convert import device_encodes
from volconv.engines.features import StructureTensorStage
from volconv.engines.nonfinite import APPLY_BYTES, OverridePlan
from volconv.engines.padder import frame_bytes
from volconv.engines.preset_memory import preset_bytes
from volconv.output import backlog_bytes, slabs_in_flight
from volconv.plan.direct import make_plan

if TYPE_CHECKING:
    from volconv.run.jobs import Job


# Page-locked slab buffers per convolver: one the device downloads into while the writer
# holds up to two (its queue), so downloads run at the bus's speed rather than page-faulting
# fresh memory (benchmarks/README.md, "The measurements behind the defaults").
PINNED_BUFFERS = 3
# Bytes of one pinned slab buffer at most: page-locking costs time at the start, a deeper slab
# makes neither the bus nor the disk faster, and a shallower one keeps the run's memory down.
MAX_PINNED_BYTES = 128 * 2**20
# A frame is read whole, once, in the file's own layout, and goes to the device as it is (a
# NIfTI is x-fastest: reading slabs along x would stride through the file, and transposing on
# the host costs more than reading; pad.cl gathers through strides instead; a .nii.gz is
# decompressed once), when the file maps (read as used) or the frame takes at most this share
# of host_memory; other frames are read slab by slab.
WHOLE_FRAME_SHARE = 4


def host_bytes(job: Job, cfg: Config, depth: int, device: cl.Device) -> int:
    """The host memory a run of ``job`` holds at slab depth ``depth`` (SPEC "Memory"): the
    pinned slab buffers (of the stored type where the device converts, else float32), a
    float32 slab converted on the host (every slab where the device does not convert; where
    it does, a slab whose source holds NaN or Inf) for each slab the writer has in flight, the
    writer's compressed chunks (`volconv.output.backlog_bytes`), the last slab padded to whole
    chunks where it is shorter, two slabs of source rows (one read ahead), the whole frame if
    it is read whole, the responses of a direct group whose filters are not neighbours in the
    bank (gathered into place), a float source's NaN and Inf override (`nonfinite_bytes`:
    the data may hold them), and on a CPU device its buffers, which are host memory too."""
    ny, nz = job.shape3[1:]
    slab = len(job.outputs) * depth * ny * nz
    stored = np.dtype(cfg.dtype).itemsize
    item = np.dtype(job.volume.dtype).itemsize
    on_device = device_encodes(device, cfg.dtype)
    total = PINNED_BUFFERS * slab * pinned_itemsize(cfg, device)
    in_flight = slabs_in_flight(cfg.compression)  # the writer's, each converted on its own
    if stored != 4 and (not on_device or np.dtype(job.volume.dtype).kind == "f"):
        total += in_flight * slab * (4 if on_device else stored)
    total += backlog_bytes(slab * stored, cfg.compression)
    if job.shape3[0] % depth:  # the writer pads the last slab's chunks to whole ones
        total += slab * stored
    total += 2 * (depth + sum(job.plan.extents[:1]) - 1) * ny * nz * item
    if job.whole_frames:
        total += math.prod(job.shape3) * item
    scattered = [len(g) for g in job.plan.groups if list(g) != list(range(g[0], g[-1] + 1))]
    total += max(scattered, default=0) * depth * ny * nz * 4
    on_host, on_cpu = nonfinite_bytes(job, depth, device)
    total += on_host
    tensor_host, tensor_device = tensor_bytes(job, depth, device)
    total += tensor_host
    if device.type & cl.device_type.CPU:
        total += replace(job.plan, slab_depth=depth).device_bytes + on_cpu + tensor_device
    return total


def tensor_bytes(job: Job, depth: int, device: cl.Device) -> tuple[int, int]:
    """The memory the feature stages take at slab depth ``depth``, as ``(host, device)``: the
    structure tensors' (`volconv.engines.features.StructureTensorStage`; on the host the
    gradients over the product rows, a product in float64 and one in float32, the six entries
    and the eigenvalues of a slab, as a slab holding NaN or Inf goes through the host; on the
    device `StructureTensorStage.device_bytes`) and the presets' (`preset_bytes`)."""
    n0, ny, nz = job.shape3
    host = device_total = 0
    for feat, _ in job.expanded.tensors:
        r = (feat.rho_filter.kernel.shape[0] - 1) // 2
        rows = min(n0, depth + 2 * r)
        host += (3 * rows + 3 * rows + 9 * depth) * ny * nz * 4
        device_total += StructureTensorStage.device_bytes(
            feat, job.shape3, job.volume.dtype, job.plan.mode, job.plan.cval, device, depth
        )
        host += 2 * min(n0, rows + feat.inputs[0].kernel.shape[0]) * ny * nz * 4  # overrides
    for preset, _ in job.expanded.presets:
        h, d = preset_bytes(preset, job.shape3, job.volume.dtype, job.plan.mode, job.plan.cval,
                            device, depth)  # fmt: skip
        host += h
        device_total += d
    return host, device_total


def override_banks(job: Job) -> list[np.ndarray]:
    """The banks a run of ``job`` builds a non-finite override for (`volconv.engines.nonfinite`), as
    `volconv.engines.separable.SeparableConvolver` does: its separable filters' (stacked to their
    common extent), then each direct group's."""
    kernels = [f.kernel for f in job.run_filters]
    if any(max(k.shape) > MAX_EXTENT for k in kernels):  # refused on a non-finite slab
        return []
    slots = [f for f, c in enumerate(job.plan.choices) if c.path != "direct"]
    banks = [stack_kernels([kernels[f] for f in slots])] if slots else []
    return banks + [np.stack([kernels[f] for f in g]) for g in job.plan.groups]


def nonfinite_bytes(job: Job, depth: int, device: cl.Device) -> tuple[int, int]:
    """The memory a slab of ``depth`` rows whose float source holds NaN or Inf takes beyond a
    finite slab's (``(0, 0)`` for integer sources, which never do), as ``(host, buffers)``.

    ``host``: the source rows' finite part and a second copy of them (the override's rows, or
    a direct group's), the separable responses gathered for the override, and the most an
    override's `~volconv.engines.nonfinite.NonFiniteOverride.apply` holds at a time (bounded, in
    sub-slabs: `volconv.engines.nonfinite.OverridePlan.host_bytes`). ``buffers``: the counting
    convolvers' buffers (uint8 0/1 banks at the slab's depth), on the device; host memory
    too on a CPU device."""
    if np.dtype(job.volume.dtype).kind != "f":
        return 0, 0
    item = np.dtype(job.volume.dtype).itemsize
    n0, ny, nz = job.shape3
    rows = min(n0, depth + job.plan.extents[0] - 1)
    host = rows * ny * nz * (2 * item + 1)
    host += job.plan.n_separable * depth * ny * nz * 4
    # the features of such a slab on the host, in float64: H's 9 entries and 3 eigenvalues
    host += 12 * 8 * depth * ny * nz * bool(job.expanded.device)
    buffers, applies = 0, [0]
    for kernels in override_banks(job):
        plan = OverridePlan.of(kernels)
        sub = plan.depth(job.shape3, depth, item, APPLY_BYTES)
        applies.append(plan.host_bytes(job.shape3, sub, item))
        for bank in plan.banks:
            counting = make_plan(job.shape3, np.dtype(np.uint8), bank.shape[1:], len(bank),
                                 job.plan.mode, 0.0, device, slab_depth=depth)  # fmt: skip
            buffers += counting.device_bytes
    return host + max(applies), buffers  # the overrides apply one after the other


def pinned_itemsize(cfg: Config, device: cl.Device) -> int:
    """Bytes per value of the pinned slab buffers: the stored type where the device converts,
    else float32."""
    return np.dtype(cfg.dtype).itemsize if device_encodes(device, cfg.dtype) else 4


def fit_host_memory(job: Job, cfg: Config, device: cl.Device) -> None:
    """Whether ``job`` reads whole frames, and its slab depth made to fit ``host_memory``."""
    frame = math.prod(job.shape3) * np.dtype(job.volume.dtype).itemsize
    job.whole_frames = job.volume.mapped or frame * WHOLE_FRAME_SHARE <= cfg.host_memory
    row = len(job.outputs) * math.prod(job.shape3[1:]) * pinned_itemsize(cfg, device)
    depth = job.plan.slab_depth
    if cfg.slab_depth is None:  # an expert's slab_depth is taken as given, if it fits
        depth = min(depth, max(1, MAX_PINNED_BYTES // row))
    if host_bytes(job, cfg, depth, device) > cfg.host_memory:  # the deepest slab that fits
        fits, over = 1, depth  # host_bytes grows with the depth
        while over - fits > 1:
            mid = (fits + over) // 2
            if host_bytes(job, cfg, mid, device) <= cfg.host_memory:
                fits = mid
            else:
                over = mid
        depth = fits
    need = host_bytes(job, cfg, depth, device)
    if need > cfg.host_memory:
        raise PipelineError(
            f"{cfg.source}: run.host_memory = {cfg.host_memory} bytes holds no slab of "
            f"{job.spec} ({need} bytes at one row)"
        )
    if cfg.slab_depth is None or depth < job.plan.slab_depth:
        job.plan = replace(job.plan, slab_depth=depth)
    job.host_bytes = host_bytes(job, cfg, job.plan.slab_depth, device)
    job.device_bytes = device_bytes(job, device)


def device_bytes(job: Job, device: cl.Device, frame_limit: int | None = None) -> int:
    """The device memory a run of ``job`` holds: its plan's buffers, a float source's
    counting convolvers (`nonfinite_bytes`: the data may hold NaN or Inf), and the whole
    frame where it is read whole and uploads as it is (an integer frame of at most
    ``frame_limit`` bytes, default `volconv.engines.padder.frame_bytes`: the `Padder` keeps it
    on the device)."""
    frame = math.prod(job.shape3) * np.dtype(job.volume.dtype).itemsize
    limit = frame_bytes(device) if frame_limit is None else frame_limit
    kept = job.whole_frames and np.dtype(job.volume.dtype).kind in "iu" and frame <= limit
    counting = nonfinite_bytes(job, job.plan.slab_depth, device)[1]
    tensors = tensor_bytes(job, job.plan.slab_depth, device)[1]
    return job.plan.device_bytes + counting + tensors + (frame if kept else 0)
