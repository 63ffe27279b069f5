"""The tensor-core engine (NVIDIA, compute capability >= 8.0) for 8-bit inputs.

`TensorConvolver` has `BankConvolver`'s slab interface and semantics (the same padded slab,
responses, non-finite override); its kernel, kernels/tensor_int8.cl, computes the valid
correlation as an implicit GEMM on ``mma.sync.m16n8k32`` (on cc 9.0 ``wgmma.mma_async``
m64nNk32, `build_sm90a`) with uint8/int8 inputs: each
filter's coefficients are scaled by a power of two into 24-bit integers and split into three
signed 8-bit digits, the digits' int32 sums are exact and combined in two float FMAs, so
the only errors are the coefficients' rounding (23 bits below each filter's largest) and the
output's (two roundings): below the FP32 kernel's at every extent measured.

Inputs 8-bit integers do not hold exactly go through `volconv.engines.digits`; filters whose
scale leaves float32's normal range stay on the FP32 kernel: `tensor_refusal` says why.
`volconv.engines.choose` chooses between the engines.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import pyopencl as cl

from volconv.device.programs import build, build_sm90a
from volconv.engines.direct import BankConvolver, as_kernel_bank
from volconv.engines.padder import native_volume
from volconv.plan.direct import pad_dtype_for

# cl_nv_device_attribute_query
CL_DEVICE_COMPUTE_CAPABILITY_MAJOR_NV = 0x4000
CL_DEVICE_COMPUTE_CAPABILITY_MINOR_NV = 0x4001
MIN_CC = (8, 0)  # mma.sync.m16n8k32 with s8/u8 inputs and s32 accumulators
TENSOR_ENGINE = "tensor-int8"  # the record's name of this engine
KERNEL_FILE, KERNEL_NAME = "tensor_int8.cl", "tensor_int8"  # kernels/: its one kernel
EXACT_TYPES = (np.dtype(np.uint8), np.dtype(np.int8))  # the tensor kernels take these as they are
DIGITS = 3  # signed 8-bit digits per coefficient: 24-bit fixed point per filter
DIGIT_MAX = 127 * (1 + 2**8 + 2**16)  # the largest integer three such digits hold


def compute_capability(device: cl.Device) -> tuple[int, int] | None:
    """An NVIDIA device's compute capability (cl_nv_device_attribute_query), else None."""
    if "cl_nv_device_attribute_query" not in device.extensions:
        return None
    try:
        return (
            int(device.get_info(CL_DEVICE_COMPUTE_CAPABILITY_MAJOR_NV)),
            int(device.get_info(CL_DEVICE_COMPUTE_CAPABILITY_MINOR_NV)),
        )
    except cl.Error:
        return None


def wgmma_supported(device: cl.Device) -> bool:
    """wgmma.mma_async is sm_90a's alone: compute capability 9.0 (H100, H200), not 8.x nor
    10.x."""
    return compute_capability(device) == (9, 0)


def tensor_supported(device: cl.Device) -> bool:
    """Whether ``device`` runs the tensor kernels: an NVIDIA GPU of cc >= 8.0."""
    cc = compute_capability(device)
    return bool(device.type & cl.device_type.GPU) and cc is not None and cc >= MIN_CC


def tensor_refusal(
    device: cl.Device,
    bank: np.ndarray,
    dtype: np.dtype,
    mode: str,
    cval: float,
    *,
    split: bool = False,
) -> str | None:
    """Why the tensor-core engine does not take this bank and volume type (None: it does):
    `TensorConvolver`'s types only, or with ``split`` every type, through
    `volconv.engines.digits.DigitConvolver`."""
    if not tensor_supported(device):
        return f"{device.name.strip()} has no mma.sync (NVIDIA cc >= 8.0 wanted)"
    src = native_volume(np.empty(0, dtype)).dtype
    if not split and src not in EXACT_TYPES:
        return f"{src} inputs are not 8-bit integers (split them: DigitConvolver)"
    if not split and pad_dtype_for(src, mode, cval) != src:
        return f"cval {cval} is not a {src} value"
    e = digit_exponents(bank)
    if np.any(e > 126) or np.any(e < -127):
        return "a filter's scale 2^-e leaves float32's normal range"
    extents = tuple(int(k) for k in bank.shape[1:])
    try:  # wide filters need plane tiles past the device's local memory
        fit_split(extents, np.dtype(np.uint8), default_shape(len(bank), extents[0]),
                  device.local_mem_size)  # fmt: skip
    except ValueError as err:
        return str(err)
    return None


@dataclass(frozen=True)
class TensorShape:
    """Work split of the tensor kernels: ``nt`` 8-filter tiles per warp, ``tyw`` output rows per
    warp, ``wy`` x ``wz`` warps per work-group, ``xc`` outputs along x per work-group;
    ``persistent`` > 0: that many work-groups per compute unit, each taking an equal run of x
    steps (``xc`` unused; groups beyond what a multiprocessor holds run as a tail wave: the
    driver takes no register cap, -cl-nv-maxrregcount is refused); ``blocal``: B fragments
    in local memory; ``dxu``: unroll of the dx loop (0: the compiler's); ``wgmma``: INT8 on
    ``wgmma.mma_async`` (sm_90a, warpgroups of 4 warps, B in local memory) instead of
    ``mma.sync``: 1 waits for each dx's MMAs, 2 loads the next dx's A meanwhile (0: off);
    ``xo``: outputs along x per step (on wgmma, xo x nt <= 4: each plane's A feeds x..x + xo - 1
    in one wgmma of up to xo times the columns)."""

    nt: int = 1
    tyw: int = 8
    wy: int = 1
    wz: int = 4
    xc: int = 32
    persistent: int = 0
    blocal: bool = False
    dxu: int = 0
    wgmma: int = 0
    xo: int = 1

    @property
    def threads(self) -> int:
        return 32 * self.wy * self.wz


# The splits below are the sweep's fastest on the H100 (benchmarks/README.md, "The tensor-core
# engine"). Devices without wgmma (`wgmma_supported`) drop it.
DEFAULT_SHAPES = {  # (filters <= 8, long: extent along x past 3 for those, past 5 for more)
    (True, True): TensorShape(1, 8, 2, 2, persistent=2, blocal=True, wgmma=1),
    (True, False): TensorShape(1, 8, 1, 4, persistent=2, blocal=True, wgmma=1),
    (False, True): TensorShape(2, 2, 2, 2, persistent=3, blocal=True, wgmma=2, xo=2),
    (False, False): TensorShape(2, 4, 2, 2, persistent=2, blocal=True, wgmma=2),
}
SM_LOCAL_BYTES = 228 * 1024  # shared memory per multiprocessor (cc 8.0 164 K, 9.0 228 K)


def default_shape(n_filters: int, kx: int = 7) -> TensorShape:
    """The measured split for ``n_filters`` filters of extent ``kx`` along x."""
    narrow = n_filters <= 8
    return DEFAULT_SHAPES[narrow, kx > (3 if narrow else 5)]


def without_wgmma(split: TensorShape) -> TensorShape:
    """``split`` on ``mma.sync``: one output along x per step."""
    return replace(split, wgmma=0, xo=1)


def fit_split(
    extents: tuple[int, int, int], src: np.dtype, split: TensorShape, local_mem: int
) -> TensorShape:
    """``split`` with one output along x per step, then without B fragments in local memory
    (and so without wgmma), then narrowed (warps along z, then along y, then rows per warp),
    until its ring of planes fits ``local_mem`` bytes: wide filters need taller and wider
    plane tiles."""
    threads = split.threads
    if split.xo > 1 and local_bytes(tensor_defines(extents, src, split)) > local_mem:
        split = replace(split, xo=1)  # a ring of two planes fewer
    if local_bytes(tensor_defines(extents, src, split)) > local_mem:  # B fragments: L1 instead
        split = replace(without_wgmma(split), blocal=False)
    while local_bytes(tensor_defines(extents, src, split)) > local_mem:
        if split.wz > 1:
            split = replace(without_wgmma(split), wz=split.wz // 2)
        elif split.wy > 1:
            split = replace(without_wgmma(split), wy=split.wy // 2)
        elif split.tyw > 1:
            split = replace(split, tyw=split.tyw // 2)
        else:
            raise ValueError(f"no work split of {KERNEL_FILE} fits {local_mem} bytes")
    if split.persistent:  # the threads asked for, as far as shared memory holds the groups
        per_group = local_bytes(tensor_defines(extents, src, split)) + 1024
        want = split.persistent * threads // split.threads
        split = replace(split, persistent=max(1, min(want, SM_LOCAL_BYTES // per_group)))
    return split


def tensor_defines(
    extents: tuple[int, int, int], src: np.dtype, shape: TensorShape, emulate: bool = False
) -> dict[str, object]:
    """Every -D of kernels/tensor_int8.cl for filters of ``extents``: rows of KZ <= 8 taps take
    one item of K (an item pair spans two rows), longer rows an even number (a pair is 16 taps
    of one row)."""
    kx, ky, kz = extents
    nseg = 1 if kz <= 8 else 2 * math.ceil(kz / 16)
    nj = math.ceil(math.ceil(ky * nseg / 2) / 2)  # MMAs of two item pairs
    rowmax = 2 * (2 * nj - 1) if nseg == 1 else (2 * nj - 1) // (nseg // 2)
    nq = max(2, nseg)
    lz_max = 11 if nseg == 1 else 19  # g + 4 (t & 1) (+ 8 (t >> 1))
    pl = 16 * (shape.wz - 1) + lz_max + 8 * (nq - 1) + 1
    pl += -pl % 4
    while nseg == 1 and not 12 <= pl % 32 <= 20:  # a warp's two rows of loads in other banks
        pl += 4
    defines = {
        "KX": kx, "KY": ky, "KZ": kz, "IN_T": "uchar" if src == np.uint8 else "char",
        "NSEG": nseg, "NJ": nj, "NROWS": shape.tyw + rowmax, "NQ": nq,
        "LROWS": shape.wy * shape.tyw + rowmax + (1 if nseg == 1 else 0), "PL": pl,
        "NT": shape.nt, "WY": shape.wy, "WZ": shape.wz, "TYW": shape.tyw, "XC": shape.xc,
    }  # fmt: skip
    if src == np.int8:
        defines["IN_SIGNED"] = 1
    if shape.xo < 1 or (shape.xo > 1 and not (shape.wgmma and shape.xo * shape.nt <= 4)):
        raise ValueError(f"xo is 1, or xo x nt <= 4 on wgmma: {shape}")
    if shape.wgmma:
        if (shape.wy * shape.wz) % 4 or shape.nt > 2:
            raise ValueError(f"wgmma takes whole warpgroups and nt <= 2: {shape}")
        defines["WGMMA"] = shape.wgmma
        defines["XO"] = shape.xo
    if shape.blocal or shape.wgmma:
        defines["BLOCAL"] = 1
    if shape.dxu:
        defines["DXU"] = shape.dxu
    if shape.persistent:  # groups per multiprocessor (`sm90a_ptx`)
        defines["PERSISTENT"] = shape.persistent
    if emulate:
        defines["EMULATE_MMA"] = 1
    return defines


def local_bytes(defines: dict[str, object]) -> int:
    """Local memory of the kernel: the ring of KX + 1 plane tiles, each warp's output stage
    and the B fragments (as many bytes in wgmma's tiles)."""
    kx, xo = int(defines["KX"]), int(defines.get("XO", 1))
    ring = 4 * (kx + 2 * xo - 1) * int(defines["LROWS"]) * int(defines["PL"])
    ring += 640 * int(defines["WY"]) * int(defines["WZ"])
    frags = 8 * kx * int(defines["NJ"]) * int(defines["NT"]) * DIGITS * 32
    frags = frags if "BLOCAL" in defines else 0
    return ring + frags


def digit_exponents(bank: np.ndarray) -> np.ndarray:
    """Per filter, the largest power of two ``e`` that keeps its largest |coefficient| x 2^e
    within `DIGIT_MAX` (in [2^22, 2^23); 0 for a zero filter)."""
    peak = np.abs(bank.reshape(len(bank), -1)).max(axis=1)
    m, ex = np.frexp(np.where(peak > 0, peak, 1.0))
    e = 23 - ex - (np.ldexp(m, 23) > DIGIT_MAX)
    return np.where(peak > 0, e, 0).astype(np.int64)


def int8_digits(bank: np.ndarray) -> np.ndarray:
    """``bank`` scaled by `digit_exponents`, rounded to integers C and split into `DIGITS`
    signed 8-bit digits, least significant first: C = d0 + 2^8 d1 + 2^16 d2, each in
    [-128, 127]."""
    c = np.rint(np.ldexp(bank, digit_exponents(bank).reshape(-1, *[1] * (bank.ndim - 1))))
    rest = c.astype(np.int64)
    digits = []
    for _ in range(DIGITS):
        d = (rest + 128) % 256 - 128
        digits.append(d)
        rest = (rest - d) // 256
    assert not rest.any(), "a coefficient past DIGIT_MAX"
    return np.stack(digits).astype(np.int8)


def int8_fragments(flipped: np.ndarray, defines: dict[str, object]) -> np.ndarray:
    """The B operands of one pass of kernels/tensor_int8.cl: ``flipped`` (F <= 8 NT filters,
    kx, ky, kz) as digits, (KX, NJ, NT, digit, lane, 2) uint32 in mma.sync.m16n8k32's layout:
    lane (g, t) holds rows k = 4t..4t+3 (b0) and 16+4t..16+4t+3 (b1) of column n = g, the
    lowest k in the lowest byte. With WGMMA: (NJ, KX descending, NT, digit) tiles of wgmma's
    K-major B without swizzle, two core matrices of 8 filters x 16 k bytes (k < 16, then
    k >= 16): tile dx - 1 follows tile dx, so one descriptor spans both (``XO`` 2)."""
    kx, ky, kz = flipped.shape[1:]
    nseg, nj, nt = (int(defines[k]) for k in ("NSEG", "NJ", "NT"))
    digits = int8_digits(flipped)  # (DIGITS, F, kx, ky, kz)
    # B[dx, j, k, n]: item 4j + k // 8 of the rows' items, tap k % 8 of it
    k = np.arange(32)
    item = np.arange(nj)[:, None] * 4 + k // 8  # (NJ, 32)
    dy, dz = item // nseg, (item % nseg) * 8 + k % 8
    valid = (dy < ky) & (dz < kz)
    frags = np.zeros((kx, nj, nt, DIGITS, 32, 2), np.uint32)
    tiles = np.zeros((kx, nj, nt, DIGITS, 2, 8, 16), np.int8)  # wgmma's: (.., k // 16, n, k % 16)
    g, t = np.arange(32) // 4, np.arange(32) % 4
    for d, part in enumerate(digits):
        coef = np.where(valid, part[:, :, np.minimum(dy, ky - 1), np.minimum(dz, kz - 1)], 0)
        full = np.zeros((8 * nt, kx, nj, 32), np.int8)  # (filter, dx, j, k)
        full[: len(part)] = coef
        if "WGMMA" in defines:
            by_tile = full.reshape(nt, 8, kx, nj, 2, 16)  # (nt, n, dx, j, k // 16, k % 16)
            tiles[:, :, :, d] = by_tile.transpose(2, 3, 0, 4, 1, 5)
            continue
        b = full.view(np.uint8).astype(np.uint32)
        for tile in range(nt):
            f = tile * 8 + g
            for reg in range(2):
                k0 = 4 * t + 16 * reg  # (lane,) indices: each gives (lane, KX, NJ)
                word = sum(b[f, :, :, k0 + i] << (8 * i) for i in range(4))
                frags[:, :, tile, d, :, reg] = word.transpose(1, 2, 0)
    if "WGMMA" in defines:
        return np.ascontiguousarray(tiles[::-1].swapaxes(0, 1)).view(np.uint32)
    return frags


class TensorConvolver(BankConvolver):
    """`BankConvolver` on the tensor cores: same parameters, slabs and results.

    Parameters
    ----------
    shape_split : TensorShape, optional
        The kernel's work split (default: `default_shape` of the bank).
    emulate : bool
        Build the kernel with mma.sync emulated through local memory, on any device (slow;
        tests of the fragment layout on PoCL).
    **kwargs
        As `BankConvolver`.
    """

    engine = TENSOR_ENGINE
    # its plan (`plan_for`): the slab in the input's own type (the A fragments are made from it
    # in the kernel; a CPU's plan would pad float32 for the FP32 kernel's sake), not the FP32
    # kernel's input tiles, rows that start at whole words
    plan_defaults: ClassVar[dict[str, object]] = {
        "pad_float": False,
        "input_local": False,
        "engine": "tensor",
    }

    def __init__(
        self,
        kernels: object,
        shape: tuple[int, int, int],
        dtype: np.dtype,
        mode: str = "reflect",
        cval: float = 0.0,
        *,
        shape_split: TensorShape | None = None,
        emulate: bool = False,
        **kwargs: object,
    ) -> None:
        bank = as_kernel_bank(kernels)
        self.split = shape_split or default_shape(len(bank), bank.shape[1])
        self.emulate = emulate
        super().__init__(bank, shape, dtype, mode, cval, **kwargs)

    def _build_passes(self) -> None:
        plan, ctx, split = self.plan, self.ctx, self.split
        reason = tensor_refusal(self.device, self.kernels, plan.src_dtype, plan.mode, plan.cval)
        if reason and not (self.emulate and "mma.sync" in reason):
            raise ValueError(f"the tensor-core engine does not take this bank: {reason}")
        if plan.padded_yz[1] % 4:  # a plan made for another engine
            raise ValueError("the tensor-core engine reads rows of whole 32-bit words: its plan "
                             "is made with engine='tensor'")  # fmt: skip
        local = self.device.local_mem_size - (6144 if self.emulate else 0)  # emulation scratch
        if split.wgmma and not (self.emulate or wgmma_supported(self.device)):
            split = without_wgmma(split)
        self.split = split = fit_split(plan.extents, plan.pad_dtype, split, local)
        self.defines = tensor_defines(plan.extents, plan.pad_dtype, split, self.emulate)
        if "WGMMA" in self.defines and not self.emulate:
            try:
                self.program = build_sm90a(ctx, KERNEL_FILE, tuple(self.defines.items()))
            except cl.Error as e:  # a driver whose PTX cannot be retargeted to sm_90a
                warnings.warn(f"wgmma did not build ({type(e).__name__}): mma.sync runs instead",
                              stacklevel=2)  # fmt: skip
                self.split = split = fit_split(plan.extents, plan.pad_dtype,
                                               without_wgmma(split), local)  # fmt: skip
                self.defines = tensor_defines(plan.extents, plan.pad_dtype, split)
        if "WGMMA" not in self.defines or self.emulate:
            self.program = build(ctx, KERNEL_FILE, tuple(self.defines.items()))
        flipped = self.kernels[:, ::-1, ::-1, ::-1]
        width = 8 * split.nt
        mf = cl.mem_flags
        self._passes = []
        for first in range(0, plan.n_filters, width):
            part = flipped[first : first + width]
            frags = int8_fragments(part, self.defines)
            unscale = np.zeros(width, np.float32)
            unscale[: len(part)] = np.ldexp(1.0, -digit_exponents(part))
            self._passes.append((
                first, len(part), cl.Kernel(self.program, KERNEL_NAME),
                cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=frags),
                cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=unscale),
            ))  # fmt: skip

    def _launch_passes(self, depth: int) -> list[cl.Event]:
        plan, s = self.plan, self.split
        ny, nz = plan.shape[1:]
        p1, p2 = plan.padded_yz
        threads = s.threads
        if s.persistent:
            glob = (threads * s.persistent * self.device.max_compute_units, 1, 1)
        else:
            glob = (threads * -(-nz // (16 * s.wz)), -(-ny // (s.wy * s.tyw)), -(-depth // s.xc))
        events = []
        for first, count, knl, frags, unscale in self._passes:
            knl.set_args(
                self._padded, self._out, frags, unscale, np.int32(depth), np.int32(ny),
                np.int32(nz), np.int32(p1), np.int32(p2), np.int64(depth * ny * nz),
                np.int32(first), np.int32(count),
            )  # fmt: skip
            events.append(cl.enqueue_nd_range_kernel(self.queue, knl, glob, (threads, 1, 1)))
        return events

    @property
    def tensor_gflop(self) -> float:
        """GFLOP the tensor cores execute for one volume: every MMA slot, zero taps, padding
        filters and every digit included (fractions of the tensor peak count these). INT8
        operations count half, as FP16-equivalent work: the dense INT8 peak is twice the FP16
        peak that the record holds (cc 8.0 to 9.0)."""
        d, s = self.defines, self.split
        per_mma = 16 * 8 * 32 // 2
        mmas = int(d["KX"]) * int(d["NJ"]) * DIGITS * len(self._passes) * s.nt
        tiles = math.prod(self.plan.shape) / 16
        return tiles * mmas * 2 * per_mma / 1e9
