"""A structure tensor's outer smoothing with its eigenvalues in two launches
(kernels/structure.cl): st_x forms the six products of the gradient planes as it reads them
and filters them along axis 0, st_yz filters them along axes 1 and 2 through local memory with
the eigenvalues as its epilogue; only the eigenvalues are written."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyopencl as cl

from volconv.engines.clock import KernelClock
from volconv.engines.features import ZeroBands, build_with_features, zero_bands_bytes
from volconv.engines.passes import cl_table

if TYPE_CHECKING:
    from volconv.engines.passes import FusedTree
    from volconv.plan.separable import SeparablePlan

# kernels/structure.cl's shape per kind of device (GPUs: as measured on the H100,
# benchmarks/results/h100-structure-*.json): st_x's UA rows and work-group (None: the driver's;
# on GPUs eight row blocks a work-group, which share the gradient rows they read in cache),
# st_yz's TY x TZ tile, UY rows and VC columns (a multiple of 4) a work-item, UB rows a task
# along axis 1, CH products a phase (1, 2, 3 or 6); RZ_ALIGN C's row length rounded up to it;
# BLOCK the output rows both launches run over at a time (0: the slab), so that C stays in cache;
# FLAT (a zero background, ZERO_SKIP): st_x computes nothing over zero values and stores no
# column of zeros where C holds zeros already, st_yz computes nothing over a tile whose bands
# st_x left unmarked, nor over zero values, and eigen_sym3 takes diagonal matrices by a branch
# (EIG_FLAT); on CPUs, which run work-items in SIMD lanes, none of it.
ST_SHAPES: dict[str, dict[str, object]] = {
    "gpu": {"UA": 8, "XG": (32, 1, 8), "TY": 16, "TZ": 64, "UY": 1, "VC": 4, "UB": 8,
            "RZ_ALIGN": 32, "BLOCK": 0, "CH": 2, "FLAT": 1},
    "cpu": {"UA": 4, "XG": None, "TY": 8, "TZ": 16, "UY": 2, "VC": 4, "UB": 4, "RZ_ALIGN": 4,
            "BLOCK": 0, "CH": 1, "FLAT": 0},
}  # fmt: skip


def st_shape(device: cl.Device) -> dict[str, object]:
    """`ST_SHAPES` of ``device``'s kind."""
    return dict(ST_SHAPES["cpu" if device.type & cl.device_type.CPU else "gpu"])


def st_extent(plan: SeparablePlan, tree: FusedTree, shape: dict[str, object]) -> tuple[int, int]:
    """C's rows (PYA) and row length (RZ) a plane: the padded columns and what the last tiles
    of ``shape`` read past them (RZ rounded up to its alignment)."""
    ny, nz = plan.shape[1:]
    ty, tz, align = int(shape["TY"]), int(shape["TZ"]), int(shape["RZ_ALIGN"])
    pya = -(-ny // ty) * ty + tree.taps[1] - 1
    rz = -(-nz // tz) * tz + tree.taps[2] - 1
    return pya, -(-rz // align) * align


def st_bytes(plan: SeparablePlan, tree: FusedTree, device: cl.Device, depth: int) -> int:
    """Device bytes of C (the six products along axis 0) and of its bands for ``depth`` output
    rows (at most a block of them)."""
    shape = st_shape(device)
    rows = min(int(shape["BLOCK"]) or depth, depth)
    pya, rz = st_extent(plan, tree, shape)
    return 6 * rows * pya * rz * 4 + zero_bands_bytes(rows, int(shape["UA"]), pya, rz)


class StructureKernels:
    """kernels/structure.cl built for ``tree`` (`volconv.engines.features.six_inputs` of the
    outer smoothing's plan: one root, mid and combo per product, the same factors) and slabs
    of at most ``depth`` output rows; ``shape`` overrides `ST_SHAPES` entries."""

    def __init__(self, ctx: cl.Context, queue: cl.CommandQueue, plan: SeparablePlan,
                 tree: FusedTree, depth: int, clock: KernelClock,
                 shape: dict[str, object] | None = None) -> None:  # fmt: skip
        self.plan, self.tree, self.queue, self.clock = plan, tree, queue, clock
        device = ctx.devices[0]
        self.shape = {**st_shape(device), **(shape or {})}
        s = self.shape
        if (s["VC"] % 4 or s["TZ"] % s["VC"] or s["TY"] % s["UY"] or s["TY"] % s["UB"]
                or s["CH"] not in (1, 2, 3, 6)):  # fmt: skip
            raise ValueError(f"structure kernels: shape {s} does not tile")
        defines = (
            ("KX", tree.taps[0]), ("KY", tree.taps[1]), ("KZ", tree.taps[2]),
            ("S0", tree.start[0]), ("S1", tree.start[1]), ("S2", tree.start[2]),
            ("WX", cl_table(np.asarray(tree.wx[0], np.float32))),
            ("WY", cl_table(np.asarray(tree.wy[0], np.float32))),
            ("WZ", cl_table(np.asarray(tree.wz[0], np.float32))),
            *((k, s[k]) for k in ("UA", "TY", "TZ", "UY", "VC", "UB", "CH")),
        )  # fmt: skip
        if plan.mode == "constant":  # the index maps hold -1 (cval)
            defines += (("CVAL_MAPS", 1),)
        if s.get("FLAT"):
            defines += (("ZERO_SKIP", 1), ("EIG_FLAT", 1))
        if s.get("NO_EIGEN"):  # scripts/bench/structure.py's timing of the epilogue
            defines += (("NO_EIGEN", 1),)
        prog = build_with_features(ctx, "structure.cl", defines)
        self._x, self._yz = cl.Kernel(prog, "st_x"), cl.Kernel(prog, "st_yz")
        ny, nz = plan.shape[1:]
        self.py, self.pz = ny + tree.taps[1] - 1, nz + tree.taps[2] - 1
        self.pya, self.rz = st_extent(plan, tree, s)
        self.block = min(int(s["BLOCK"]) or depth, depth)
        size = 6 * self.block * self.pya * self.rz * 4  # st_bytes of this shape
        self._c = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, size)
        self._bands = ZeroBands(ctx, self.block, int(s["UA"]), self.pya, self.rz)

    @property
    def held_bytes(self) -> int:
        """Device memory it holds (C and its bands)."""
        return self._c.size + self._bands.nbytes

    def launch(self, g: cl.Buffer, g_plane: int, m0: np.ndarray, m1: cl.Buffer, m2: cl.Buffer,
               cval: float, feat: cl.Buffer, depth: int) -> list[cl.Event]:  # fmt: skip
        """Enqueue both launches for ``depth`` output rows, a block of rows at a time: the
        products of the three planes ``g`` (``g_plane`` elements apart) read through the index
        maps ``m0`` (the padded rows' rows of ``g``), ``m1``, ``m2`` (-1: ``cval``); the
        eigenvalues into ``feat`` (3, depth, ny, nz)."""
        s, i32 = self.shape, np.int32
        # the rows st_x's last work-items read past the map: row 0, never stored
        rows = np.concatenate([m0, np.zeros(int(s["UA"]), np.int32)]).astype(np.int32)
        m0 = cl.Buffer(self._c.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                       hostbuf=rows)  # fmt: skip
        ny, nz = self.plan.shape[1:]
        xg = s["XG"]
        group = (s["TZ"] // s["VC"], s["TY"] // s["UY"], 1)
        events = []
        for x0 in range(0, depth, self.block):
            nx = min(self.block, depth - x0)
            epoch = self._bands.advance()
            self._x.set_args(g, np.int64(g_plane), self._c, m0, m1, m2, i32(x0), i32(nx),
                             i32(self.block), i32(self.py), i32(self.pz), i32(ny), i32(nz),
                             i32(self.pya), i32(self.rz), np.float32(cval), self._bands.buffer,
                             epoch, self._bands.held)  # fmt: skip
            self._yz.set_args(self._c, feat, i32(x0), i32(nx), i32(self.block), i32(depth),
                              i32(ny), i32(nz), i32(self.pya), i32(self.rz), self._bands.buffer,
                              epoch)  # fmt: skip
            glob = (self.pz, self.py, -(-nx // s["UA"]))
            if xg is not None:
                glob = tuple(-(-n // g) * g for n, g in zip(glob, xg, strict=True))
            yz = (-(-nz // s["TZ"]) * group[0], -(-ny // s["TY"]) * group[1], nx)
            for name, k, gl, gr in (("st_x", self._x, glob, xg),
                                    ("st_yz", self._yz, yz, group)):  # fmt: skip
                event = cl.enqueue_nd_range_kernel(self.queue, k, gl, gr)
                events.append(self.clock.add(name, event))
        return events
