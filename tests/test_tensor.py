"""The tensor-core engine: its choice and fallback (every device), its fragment layout (the
kernel with mma.sync emulated, on any device) and its results on NVIDIA cc >= 8.0 against
scipy.ndimage.convolve in float64 at the contract's tolerance."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyopencl as cl
import pytest
from conftest import assert_spec_close, reference

from volconv.checks import spec_tolerance
from volconv.device.programs import kernel_folder, sm90a_ptx
from volconv.engines.choose import (
    MIN_TENSOR_FILTERS,
    auto_engine,
    choose_engine,
    direct_convolver,
    direct_plan,
    tensor_pays,
)
from volconv.engines.digits import FLOAT_DIGITS, DigitConvolver, digit_types
from volconv.engines.direct import BankConvolver
from volconv.engines.registry import ENGINES
from volconv.engines.separable import SeparableConvolver
from volconv.engines.tensor import (
    DIGIT_MAX,
    DIGITS,
    KERNEL_FILE,
    TENSOR_ENGINE,
    TensorConvolver,
    TensorShape,
    default_shape,
    digit_exponents,
    fit_split,
    int8_digits,
    int8_fragments,
    local_bytes,
    tensor_defines,
    tensor_refusal,
    tensor_supported,
    wgmma_supported,
)
from volconv.plan.direct import make_plan
from volconv.plan.knobs import TUNE_FILE, TUNE_FORMAT, kernel_hash, tune_keys
from volconv.plan.separable import make_separable_plan, plan_bank
from volconv.report import write_json

MODES = ("reflect", "mirror", "nearest", "constant", "wrap")


def direct(bank: np.ndarray) -> list:
    """Every filter on the direct path (the engines under test), whatever the cost model."""
    return plan_bank(bank, force="direct")


def assert_nonfinite_as_scipy(
    out: np.ndarray, vol: np.ndarray, bank: np.ndarray, ref: np.ndarray
) -> None:
    """NaN and Inf where scipy has them; the finite outputs within the contract's tolerance of the
    volume's finite part."""
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(out[np.isinf(ref)], ref[np.isinf(ref)])
    finite = np.isfinite(ref)
    err = np.abs(np.where(finite, out, 0) - np.where(finite, ref, 0)).max(axis=(1, 2, 3))
    vmax = float(np.abs(vol[np.isfinite(vol)]).max())
    assert np.all(err <= [spec_tolerance(k, vmax) for k in bank])


def run(conv: BankConvolver, volume: np.ndarray) -> np.ndarray:
    """Every slab of ``volume`` through ``conv``: the seams between slabs included."""
    out = np.empty((conv.plan.n_filters, *volume.shape), np.float32)
    for a, b in conv.slabs():
        conv.convolve_slab(a, b, volume[conv.source_rows(a, b)], out[:, a:b])
    return out


def volume_of(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(shape) * 1000).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, int(info.max) + 1, shape).astype(dtype)


# -- choice and fallback ------------------------------------------------------------------


def test_engine_choice_and_fallback(device):
    """Where the device has no mma.sync (PoCL, other GPUs) the direct groups take the FP32
    kernel and the record says so; on NVIDIA cc >= 8 uint8 banks take the tensor cores
    (from MIN_TENSOR_FILTERS filters on: fewer run faster on the FP32 kernel)."""
    bank = np.random.default_rng(1).standard_normal((MIN_TENSOR_FILTERS, 3, 3, 3))
    shape = (9, 10, 11)
    conv = direct_convolver(bank, shape, np.uint8, device=device)
    sep = SeparableConvolver(bank, shape, np.uint8, device=device, choices=direct(bank))
    if tensor_supported(device):
        assert type(conv) is TensorConvolver and conv.engine == TENSOR_ENGINE
        assert sep.engines == [TENSOR_ENGINE] and sep.tensor_gflop > 0
    else:
        assert type(conv) is BankConvolver and conv.engine == "fp32"
        assert sep.engines == ["fp32"] and sep.tensor_gflop == 0
        assert "mma.sync" in tensor_refusal(device, bank, np.dtype(np.uint8), "reflect", 0.0)
        with pytest.raises(ValueError, match=r"mma\.sync"):
            direct_convolver(bank, shape, np.uint8, device=device, engine="tensor")
        with pytest.raises(ValueError, match=r"mma\.sync"):
            TensorConvolver(bank, shape, np.uint8, device=device)
    few = direct_convolver(bank[: MIN_TENSOR_FILTERS - 1], shape, np.uint8, device=device)
    assert few.engine == "fp32"
    forced = SeparableConvolver(bank, shape, np.uint8, device=device, choices=direct(bank),
                                engine="fp32")  # fmt: skip
    assert forced.engines == ["fp32"]
    vol = volume_of(np.uint8, shape)
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, "reflect"))


def test_a_separable_plan_holds_its_direct_groups_plans(device):
    """Planned once: `make_separable_plan` chooses each direct group's engine and plans it
    (`direct_plan`), and the plan holds those plans; the convolver builds each group from its
    plan at the bank's slab depth (one changed after planning too, as the pipeline's memory
    bound may) and gives scipy's responses."""
    rng = np.random.default_rng(2)
    bank = [rng.standard_normal((3, 3, 3)) for _ in range(MIN_TENSOR_FILTERS)]
    bank.append(rng.standard_normal((5, 3, 3)))
    shape = (9, 10, 11)
    plan = make_separable_plan(
        bank, shape, np.uint8, "reflect", 0.0, device, choices=direct(bank), tuned=False
    )  # the rule, not a cache
    assert [len(g) for g in plan.groups] == [MIN_TENSOR_FILTERS, 1]
    wanted = [direct_plan(np.stack([bank[f] for f in g]), shape, np.uint8, device=device,
                          slab_depth=1, tuned=False) for g in plan.groups]  # fmt: skip
    assert list(plan.direct_plans) == wanted
    assert [p.engine for p in wanted] == ["tensor" if tensor_supported(device) else "fp32", "fp32"]
    plan = replace(plan, slab_depth=4)
    conv = SeparableConvolver(bank, shape, np.uint8, device=device, plan=plan)
    assert [c.plan for c in conv._direct] == [replace(p, slab_depth=4) for p in wanted]
    vol = volume_of(np.uint8, shape)
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, "reflect"))


def test_int16_choice(device):
    """Untuned, 16-bit integer banks take the tensor cores as two digit slabs from 7^3 taps
    where the device has them (faster there), the FP32 kernel below and elsewhere."""
    rng = np.random.default_rng(5)
    shape = (9, 10, 11)
    vol = volume_of(np.int16, shape)
    for k, tensor in ((7, tensor_supported(device)), (5, False)):
        bank = rng.standard_normal((MIN_TENSOR_FILTERS, k, k, k))
        conv = direct_convolver(bank, shape, np.int16, device=device, tuned=False)
        assert conv.engine == (f"{TENSOR_ENGINE}x2" if tensor else "fp32"), k
        assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, "reflect"))


def test_tuned_engine_choice_and_fallback(device, tmp_path, monkeypatch):
    """'auto' takes the engine ``volconv bench --tune`` cached for the bank shape where it
    runs; a cached tensor engine on a device without tensor cores is ignored with a warning,
    the FP32 kernel taking the bank (results as scipy's either way)."""
    monkeypatch.setenv("VOLCONV_CACHE_DIR", str(tmp_path))
    bank = np.random.default_rng(12).standard_normal((2, 3, 3, 3))  # the rule: FP32
    shape = (9, 10, 11)
    dev_key, bank_key = tune_keys(device, (3, 3, 3), 2, np.dtype(np.int16))
    cached = {"format": TUNE_FORMAT, "kernel": kernel_hash(), "engine": "tensor",
              "vector_width": None, "unroll": 4, "local_size": [4, 2]}  # fmt: skip
    write_json({dev_key: {bank_key: cached}}, tmp_path / TUNE_FILE)
    assert auto_engine(device, bank, np.dtype(np.int16), "reflect", 0.0, tuned=False) == "fp32"
    if tensor_supported(device):
        conv = direct_convolver(bank, shape, np.int16, device=device)
        assert type(conv) is DigitConvolver and conv.engine == f"{TENSOR_ENGINE}x2"
    else:
        with pytest.warns(RuntimeWarning, match="names engine 'tensor', which does not run"):
            conv = direct_convolver(bank, shape, np.int16, device=device)
        assert type(conv) is BankConvolver and conv.engine == "fp32"
    vol = volume_of(np.int16, shape)
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, "reflect"))


def test_digit_types():
    """8-bit slabs stay whole; 16-bit integers are two digits; floats, and a cval off an
    integer type, a fixed point of FLOAT_DIGITS; the top digit signed where the type is."""
    u8, i8 = np.dtype(np.uint8), np.dtype(np.int8)
    assert digit_types(np.uint8) == (u8,) and digit_types(np.int8, "constant", -128) == (i8,)
    assert digit_types(np.int16) == (i8, u8) and digit_types(np.uint16) == (u8, u8)
    floats = (i8, *[u8] * (FLOAT_DIGITS - 1))
    assert digit_types(np.float32) == digit_types(np.float64) == floats
    assert digit_types(np.uint8, "constant", 0.5) == digit_types(np.int16, "constant", 1e6)
    assert digit_types(np.int16, "constant", 1e6) == floats
    assert digit_types(np.uint8, "reflect", 0.5) == (u8,)  # cval unused outside constant


def test_tensor_pays():
    """'auto' takes the tensor cores from 4 filters, at every extent for 8-bit slabs (exact INT8
    sums), from 7^3 taps for two digits (16-bit integers), never for three (floats)."""
    assert tensor_pays(MIN_TENSOR_FILTERS, (7, 7, 7)) and tensor_pays(32, (9, 9, 9))
    assert not tensor_pays(MIN_TENSOR_FILTERS - 1, (7, 7, 7))
    assert tensor_pays(8, (11, 11, 11)) and tensor_pays(8, (31, 31, 1))
    assert tensor_pays(8, (3, 3, 3), digits=1)
    assert tensor_pays(8, (7, 7, 7), digits=2) and tensor_pays(8, (1, 19, 19), digits=2)
    assert not tensor_pays(8, (5, 5, 5), digits=2) and not tensor_pays(8, (9, 9, 1), digits=2)
    assert not tensor_pays(MIN_TENSOR_FILTERS - 1, (11, 11, 11), digits=2)
    assert not tensor_pays(32, (11, 11, 11), digits=3)


def test_engine_knob(monkeypatch):
    monkeypatch.setenv("VOLCONV_ENGINE", "fp32")
    assert choose_engine() == "fp32"
    assert choose_engine("tensor") == "tensor"
    monkeypatch.setenv("VOLCONV_ENGINE", "fp16")
    with pytest.raises(ValueError, match="engine must be one of"):
        choose_engine()


def test_refusals_name_the_reason(device):
    """Types 8-bit integers do not hold exactly, a cval off the type and extreme scales stay on
    FP32."""
    if not tensor_supported(device):
        pytest.skip("the refusals past the device's are reached on NVIDIA cc >= 8.0 only")
    bank = np.ones((1, 3, 3, 3))
    ok = tensor_refusal(device, bank, np.dtype(np.uint8), "reflect", 0.0)
    assert ok is None
    for dt in (np.int16, np.uint16, np.float32, np.float64):
        assert "not 8-bit integers" in tensor_refusal(device, bank, np.dtype(dt), "reflect", 0.0)
    assert "cval" in tensor_refusal(device, bank, np.dtype(np.uint8), "constant", 0.5)
    assert tensor_refusal(device, bank, np.dtype(np.uint8), "constant", 7.0) is None
    assert "normal range" in tensor_refusal(device, bank * 1e-38, np.dtype(np.uint8), "wrap", 0)
    # 2^-e of the digits' 24-bit scale would be subnormal, though the filter is normal
    assert "normal range" in tensor_refusal(device, bank * 2.0**-110, np.dtype(np.uint8), "wrap", 0)
    # filters too wide for any work split's plane tiles: the FP32 kernel takes them
    wide = np.ones((8, 31, 31, 31))
    assert "no work split" in tensor_refusal(device, wide, np.dtype(np.uint8), "reflect", 0.0)


def test_wide_filters_fit_no_split():
    """31^3 filters need plane tiles past 48 KiB of local memory (NVIDIA's OpenCL limit) for
    every work split: `tensor_refusal` says so, and 'auto' keeps them on the FP32 kernel."""
    with pytest.raises(ValueError, match="no work split"):
        fit_split((31, 31, 31), np.dtype(np.uint8), default_shape(8, 31), 48 * 1024)
    assert fit_split((7, 7, 7), np.dtype(np.uint8), default_shape(8, 7), 48 * 1024).wgmma


# -- the coefficient split and fragments (pure) -------------------------------------------


def test_digits_are_exact_24_bit_fixed_point():
    """Three signed 8-bit digits rebuild each filter scaled into [2^22, 2^23) and rounded to
    an integer: exactly, and within half a unit of the scaled coefficient."""
    rng = np.random.default_rng(8)
    bank = rng.standard_normal((6, 3, 4, 5)) * 10.0 ** rng.integers(-9, 9, (6, 1, 1, 1))
    bank[1] *= 2.0**-31 * DIGIT_MAX / np.abs(bank[1]).max()
    bank[1, 0, 0, 0] = DIGIT_MAX * 2.0**-30  # a peak right at the largest integer
    bank[2] = 0.0
    e = digit_exponents(bank)
    digits = int8_digits(bank).astype(np.int64)
    assert digits.shape == (DIGITS, *bank.shape)
    rebuilt = digits[0] + 256 * digits[1] + 65536 * digits[2]
    scaled = np.ldexp(bank, e[:, None, None, None])
    assert np.all(np.abs(rebuilt - scaled) <= 0.5)
    peak = np.abs(rebuilt).max(axis=(1, 2, 3))
    assert np.all(peak[[0, 1, 3, 4, 5]] >= 2**22) and np.all(peak <= DIGIT_MAX)
    assert peak[1] == DIGIT_MAX and e[2] == 0


@pytest.mark.parametrize("extents", [(7, 7, 7), (2, 5, 3), (3, 4, 9), (1, 3, 17), (2, 2, 31)])
def test_int8_fragments_hold_every_tap_once(extents):
    """The INT8 B fragments, read back by mma.sync.m16n8k32's layout, rebuild every digit of
    every tap exactly once, and nothing else."""
    rng = np.random.default_rng(2)
    bank = rng.standard_normal((11, *extents))
    d = tensor_defines(extents, np.dtype(np.uint8), TensorShape(nt=2))
    frags = int8_fragments(bank, d)
    nseg = d["NSEG"]
    kx = extents[0]
    rebuilt = np.zeros((DIGITS, 16, *extents), np.int64)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    for dx in range(kx):
        for j in range(d["NJ"]):
            for reg in range(2):
                for byte in range(4):
                    k = 4 * t + 16 * reg + byte
                    item = 4 * j + k // 8
                    dy, dz = item // nseg, (item % nseg) * 8 + k % 8
                    value = (frags[dx, j, :, :, :, reg] >> (8 * byte)) & 0xFF  # (NT, digit, lane)
                    value = value.astype(np.uint8).view(np.int8).astype(np.int64)
                    inside = (dy < extents[1]) & (dz < extents[2])
                    assert np.all(value[:, :, ~inside] == 0)
                    for tile in range(2):
                        f = 8 * tile + g[inside]
                        for digit in range(DIGITS):
                            np.add.at(rebuilt[digit], (f, dx, dy[inside], dz[inside]),
                                      value[tile, digit, inside])  # fmt: skip
    assert np.array_equal(rebuilt[:, :11], int8_digits(bank))
    assert not rebuilt[:, 11:].any()


def test_fit_split_drops_local_b_fragments_first():
    """B fragments leave local memory before the plane tiles shrink; persistent groups keep
    the threads per multiprocessor asked for."""
    u8 = np.dtype(np.uint8)
    split = TensorShape(1, 8, 2, 2, persistent=2, blocal=True)
    assert fit_split((7, 7, 7), u8, split, 48 * 1024) == split
    wide = fit_split((11, 11, 11), u8, split, 48 * 1024)  # 50 KB of B fragments
    assert not wide.blocal and wide.wz == 1 and wide.persistent == 4
    assert local_bytes(tensor_defines((11, 11, 11), u8, wide)) <= 48 * 1024
    pair = TensorShape(1, 8, 2, 2, persistent=2, wgmma=1, xo=2)  # 40 KB of ring: xo 1 fits
    assert fit_split((7, 7, 7), u8, pair, 48 * 1024) == replace(pair, xo=1)
    assert fit_split((7, 7, 7), u8, replace(pair, tyw=4), 48 * 1024) == replace(pair, tyw=4)


# -- the kernel with mma.sync emulated (any device) -----------------------------------------


@pytest.mark.parametrize(
    ("extents", "n", "shape", "mode", "dtype", "split"),
    [
        ((3, 5, 7), 3, (6, 9, 20), "reflect", np.uint8, TensorShape(1, 2, 1, 2, 4)),
        ((2, 4, 11), 13, (9, 10, 21), "constant", np.int8, TensorShape(2, 2, 2, 1, 3)),
        ((4, 2, 2), 5, (7, 6, 18), "mirror", np.uint8, TensorShape(1, 3, 2, 2, 5)),
        ((2, 3, 4), 2, (5, 7, 9), "wrap", np.uint8, TensorShape(1, 2, 1, 1, 4)),
        (
            (3, 5, 7),
            3,
            (6, 9, 20),
            "nearest",
            np.uint8,
            TensorShape(1, 2, 1, 2, persistent=1, blocal=True, dxu=2),
        ),
        ((5, 3, 17), 9, (8, 9, 19), "reflect", np.int8, TensorShape(2, 1, 1, 1, persistent=3)),
        ((2, 2, 31), 9, (5, 6, 40), "nearest", np.int8, TensorShape(2, 1, 1, 2, persistent=2)),
        ((3, 3, 5), 10, (6, 7, 22), "reflect", np.uint8, TensorShape(2, 2, 1, 2, 3, blocal=True)),
        # wgmma (warpgroups of 4 warps, B tiles in local memory), emulated per 8 columns
        ((3, 5, 7), 3, (6, 9, 40), "reflect", np.uint8, TensorShape(1, 2, 2, 2, 4, wgmma=1)),
        ((2, 4, 11), 13, (9, 10, 45), "constant", np.int8, TensorShape(2, 1, 1, 4, 3, wgmma=2)),
        (
            (3, 3, 5),
            10,
            (6, 9, 22),
            "mirror",
            np.uint8,
            TensorShape(2, 2, 2, 2, persistent=1, wgmma=2),
        ),
        # two outputs along x per step: runs of 3 (the last step's second output past it)
        ((3, 5, 7), 3, (7, 9, 40), "reflect", np.uint8, TensorShape(1, 2, 2, 2, 3, wgmma=2, xo=2)),
        ((2, 4, 11), 13, (9, 10, 45), "wrap", np.int8, TensorShape(2, 1, 1, 4, 4, wgmma=1, xo=2)),
        ((1, 3, 4), 5, (5, 6, 20), "nearest", np.uint8, TensorShape(1, 1, 1, 4, 2, wgmma=2, xo=2)),
        # three, four along x (slabs of 4 rows): runs of 3 and 1, of 2, of 4 then 0 past (KX < XO)
        ((5, 3, 6), 6, (7, 8, 20), "reflect", np.uint8, TensorShape(1, 2, 1, 4, 3, wgmma=2, xo=4)),
        ((2, 4, 3), 3, (9, 7, 18), "wrap", np.int8, TensorShape(1, 1, 1, 4, 2, wgmma=1, xo=4)),
        ((3, 3, 9), 7, (8, 6, 21), "mirror", np.uint8, TensorShape(1, 1, 1, 4, 5, wgmma=2, xo=3)),
        (
            (4, 3, 5),
            10,
            (7, 9, 22),
            "mirror",
            np.uint8,
            TensorShape(2, 2, 2, 2, persistent=1, wgmma=2, xo=2),
        ),
    ],
)
def test_emulated_layout(device, extents, n, shape, mode, dtype, split):
    """kernels/tensor_int8.cl with mma.sync (and wgmma) emulated by its PTX fragment layout:
    the items, rows, lanes, ring and persistent runs of the real kernel, checked on any device
    (slabs of 4 rows)."""
    bank = np.random.default_rng(3).standard_normal((n, *extents))
    vol = volume_of(dtype, shape)
    conv = TensorConvolver(bank, shape, dtype, mode, 3.0, device=device, emulate=True,
                           shape_split=split, slab_depth=4)  # fmt: skip
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, mode, 3.0))


@pytest.mark.parametrize("split", [TensorShape(1, 2, 1, 2, 4), TensorShape(1, 2, 2, 2, 4, wgmma=1)])
def test_emulated_rows_of_whole_words(device, split):
    """The kernel reads the slab's rows as aligned 32-bit words: its plan rounds P2 up to a
    multiple of 4 (here from 34), the last bytes of the slab read; a plan made for the FP32
    kernel is refused."""
    bank = np.random.default_rng(4).standard_normal((2, 3, 3, 3))
    vol = volume_of(np.uint8, (5, 7, 32))
    conv = TensorConvolver(bank, vol.shape, np.uint8, "reflect", device=device, emulate=True,
                           shape_split=split, slab_depth=3)  # fmt: skip
    fp32 = make_plan(vol.shape, np.dtype(np.uint8), (3, 3, 3), 2, "reflect", 0.0, device,
                     unroll=16)  # fmt: skip
    assert (fp32.padded_yz[1], conv.plan.padded_yz[1]) == (34, 36)
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, "reflect", 0.0))
    with pytest.raises(ValueError, match="whole 32-bit words"):
        TensorConvolver(bank, vol.shape, np.uint8, device=device, emulate=True, plan=fp32)


@pytest.mark.parametrize(
    ("dtype", "mode", "cval", "n", "extents"),
    [
        (np.int16, "reflect", 0.0, 3, (3, 4, 5)),
        (np.uint16, "wrap", 0.0, 9, (2, 3, 4)),
        (np.float32, "constant", 2.5, 3, (3, 4, 5)),
        (np.uint8, "constant", 0.5, 2, (4, 2, 3)),
        (np.float64, "mirror", 0.0, 1, (1, 3, 2)),
        (np.int16, "nearest", 0.0, 2, (3, 3, 3)),
    ],
)
def test_emulated_digits(device, dtype, mode, cval, n, extents):
    """`DigitConvolver` over the emulated kernel: the split into digit slabs (signed top
    digit), the float fixed point's per-slab scale, the FP32 sums, on any device (slabs of 4
    rows, each with its own scale)."""
    bank = np.random.default_rng(9).standard_normal((n, *extents))
    shape = (9, 9, 20)
    vol = volume_of(dtype, shape, 1)
    if np.dtype(dtype).kind == "f":
        vol[:4] *= 1e-3  # a first slab of smaller values: another scale
    conv = DigitConvolver(bank, shape, dtype, mode, cval, device=device, emulate=True,
                          shape_split=TensorShape(1, 2, 1, 2, 4), slab_depth=4)  # fmt: skip
    assert conv.engine == f"{TENSOR_ENGINE}x{len(digit_types(dtype, mode, cval))}"
    assert conv.tensor_gflop > 0
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, mode, cval))


def test_emulated_digits_nonfinite(device):
    """NaN and Inf voxels as scipy propagates them, the finite part through the digits."""
    bank = np.random.default_rng(11).standard_normal((2, 3, 2, 3))
    shape = (8, 7, 17)
    vol = volume_of(np.float32, shape)
    vol[1, 2, 3], vol[5, 5, 5], vol[6, 0, 16] = np.nan, np.inf, -np.inf
    conv = DigitConvolver(bank, shape, np.float32, "reflect", device=device, emulate=True,
                          shape_split=TensorShape(1, 2, 1, 2, 4), slab_depth=4)  # fmt: skip
    out = run(conv, vol)
    assert_nonfinite_as_scipy(out, vol, bank, reference(vol, bank, "reflect"))


# -- the kernel on the tensor cores (NVIDIA cc >= 8.0) -------------------------------------


@pytest.fixture
def nvidia(device):
    if not tensor_supported(device):
        pytest.skip("needs an NVIDIA GPU of compute capability >= 8.0 (mma.sync)")
    return device


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extents", [(7, 7, 7), (3, 4, 5), (2, 6, 11)])
def test_tensor_modes(nvidia, mode, extents):
    """Every mode, odd and even extents, slabs of 7 rows (seams), cval an integer."""
    bank = np.random.default_rng(4).standard_normal((8, *extents))
    shape = (26, 23, 37)
    vol = volume_of(np.uint8, shape)
    conv = direct_convolver(bank, shape, np.uint8, mode, 9.0, device=nvidia, slab_depth=7)
    assert conv.engine == TENSOR_ENGINE
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, mode, 9.0))


@pytest.mark.parametrize("n", [1, 8, 13, 32])
@pytest.mark.parametrize("extents", [(5, 5, 5), (4, 1, 8), (1, 1, 1), (9, 8, 17)])
def test_tensor_filters(nvidia, n, extents):
    rng = np.random.default_rng(n)
    bank = rng.standard_normal((n, *extents)) * 10.0 ** rng.integers(-6, 6, (n, 1, 1, 1))
    shape = (33, 40, 70)
    vol = volume_of(np.int8, shape, n)
    conv = TensorConvolver(bank, shape, np.int8, "reflect", device=nvidia, slab_depth=13)
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, "reflect"))


@pytest.mark.parametrize("persistent", [0, 2])
@pytest.mark.parametrize("extents", [(7, 7, 7), (4, 4, 12)])
def test_tensor_splits(nvidia, extents, persistent):
    """The work splits the benchmark sweeps, grid and persistent, give the same results."""
    bank = np.random.default_rng(7).standard_normal((16, *extents))
    shape = (37, 45, 53)
    vol = volume_of(np.uint8, shape)
    for split in (
        TensorShape(1, 8, 2, 2, 16, persistent, blocal=True),
        TensorShape(2, 4, 1, 4, 8, persistent, dxu=1),
    ):
        conv = TensorConvolver(bank, shape, np.uint8, "wrap", device=nvidia, shape_split=split,
                               slab_depth=20)  # fmt: skip
        assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, "wrap"))


def test_wgmma_defaults(device):
    """The default splits ask for wgmma; only cc 9.0 (sm_90a) has it, and a CPU never."""
    assert all(default_shape(n, kx).wgmma for n in (8, 32) for kx in (3, 7))
    if device.type & cl.device_type.CPU:
        assert not wgmma_supported(device)


PTX = """.version 7.8
.target sm_90
.address_size 64
.entry tensor_int8(
\t.param .u64 tensor_int8_param_0,
\t.param .u32 tensor_int8_param_1
)%s
{
\t//@ wgmma.fence.sync.aligned;
\tbar.warp.sync -1;
}
"""


@pytest.mark.parametrize("bound", ["", "\n.reqntid 128, 1, 1"])
def test_sm90a_ptx(bound):
    """The wgmma kernel's PTX as built for sm_90a: its wgmma lines uncommented, target and ISA
    raised, and a persistent split's groups per multiprocessor said to ptxas."""
    text = sm90a_ptx(PTX % bound, 3, 128)
    assert ".target sm_90a\n" in text and ".version 8.0\n" in text
    assert "\twgmma.fence.sync.aligned;" in text and "//@" not in text
    head = text[text.index(".entry") : text.index("{")]
    assert head.count(".minnctapersm 3") == 1
    assert head.count(".maxntid 128, 1, 1") == (0 if bound else 1)
    assert ".minnctapersm" not in sm90a_ptx(PTX % bound)


@pytest.mark.parametrize(("wgmma", "xo"), [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)])
@pytest.mark.parametrize(
    ("extents", "n", "dtype", "split"),
    [
        ((7, 7, 7), 8, np.uint8, TensorShape(1, 8, 2, 2, persistent=2)),
        ((7, 7, 7), 13, np.int8, TensorShape(1, 8, 2, 2, 16)),
        ((4, 4, 12), 16, np.uint8, TensorShape(2, 4, 2, 2, persistent=2)),
        ((3, 5, 17), 32, np.int8, TensorShape(2, 4, 1, 4, 8)),
        ((2, 1, 1), 1, np.uint8, TensorShape(1, 2, 1, 4, persistent=1)),
    ],
)
def test_tensor_wgmma(nvidia, extents, n, dtype, split, wgmma, xo):
    """The INT8 kernel on wgmma.mma_async (sm_90a; cc 8.x builds refuse it) as exact as on
    mma.sync, one or two outputs along x per step."""
    if not wgmma_supported(nvidia):
        pytest.skip("wgmma needs sm_90a")
    bank = np.random.default_rng(n).standard_normal((n, *extents))
    shape = (29, 38, 71)
    vol = volume_of(dtype, shape, n)
    conv = TensorConvolver(bank, shape, dtype, "reflect", device=nvidia, slab_depth=12,
                           shape_split=replace(split, wgmma=wgmma, xo=min(xo, 4 // split.nt),
                                               tyw=max(1, split.tyw // xo)))  # fmt: skip
    assert conv.defines["WGMMA"] == wgmma and conv.defines["XO"] == min(xo, 4 // split.nt)
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, "reflect"))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.float32])
def test_tensor_dtypes(nvidia, dtype):
    """uint8 and int8 take the tensor cores; int16 and float32, untuned, the FP32 kernel
    (their digits measured slower); as exact either way."""
    bank = np.random.default_rng(5).standard_normal((8, 5, 6, 7))
    shape = (30, 31, 45)
    vol = volume_of(dtype, shape)
    sep = SeparableConvolver(bank, shape, dtype, "mirror", device=nvidia, slab_depth=11,
                             choices=direct(bank), tuned=False)  # fmt: skip
    assert sep.engines == [TENSOR_ENGINE if len(digit_types(dtype)) == 1 else "fp32"]
    out = run(sep, vol)
    assert_spec_close(out, vol, bank, reference(vol, bank, "mirror"))


def test_tensor_cval_off_type_takes_digits(nvidia):
    """A cval off uint8 pads the slab in float32: the FP32 kernel untuned, the digits
    forced."""
    bank = np.random.default_rng(8).standard_normal((8, 3, 3, 3))
    auto = direct_convolver(bank, (8, 9, 10), np.uint8, "constant", 0.5, device=nvidia,
                            tuned=False)  # fmt: skip
    assert auto.engine == "fp32"
    conv = direct_convolver(bank, (8, 9, 10), np.uint8, "constant", 0.5, device=nvidia,
                            engine="tensor")  # fmt: skip
    assert conv.engine == f"{TENSOR_ENGINE}x{FLOAT_DIGITS}"
    vol = volume_of(np.uint8, (8, 9, 10))
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, "constant", 0.5))


# -- inputs split into 8-bit digits on the tensor cores (NVIDIA cc >= 8.0) ----------------

SPLIT_TYPES = (np.uint8, np.int16, np.float32)  # uint8: a cval off the type splits it


def split_case(dtype, mode: str) -> tuple[float, str]:
    """The cval of a case (uint8: a fraction, so the slab is float32 and split) and the
    engine name its digits give."""
    cval = 2.5 if dtype == np.uint8 else -3.0
    digits = len(digit_types(dtype, "constant" if dtype == np.uint8 else mode, cval))
    return cval, f"{TENSOR_ENGINE}x{digits}"


@pytest.mark.parametrize("dtype", SPLIT_TYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extents", [(7, 7, 7), (4, 6, 2)])
def test_split_modes(nvidia, mode, dtype, extents):
    """Every mode, odd and even extents, slabs of 7 rows (seams); the digit slabs through the
    tensor cores (uint8 with a cval off the type, in constant mode only)."""
    if dtype == np.uint8 and mode != "constant":
        pytest.skip("uint8 splits only for a cval off the type")
    bank = np.random.default_rng(10).standard_normal((8, *extents))
    shape = (26, 23, 37)
    cval, engine = split_case(dtype, mode)
    vol = volume_of(dtype, shape)
    conv = direct_convolver(bank, shape, dtype, mode, cval, device=nvidia, slab_depth=7,
                            engine="tensor")  # fmt: skip
    assert conv.engine == engine
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, mode, cval))


@pytest.mark.parametrize("dtype", SPLIT_TYPES)
@pytest.mark.parametrize("n", [1, 8, 13, 32])
@pytest.mark.parametrize("extents", [(5, 5, 5), (4, 2, 8), (6, 3, 10)])
def test_split_filters(nvidia, n, extents, dtype):
    """N in {1, 8, 13, 32} (one pass, several, a partial one), even extents, filters of very
    different scales."""
    rng = np.random.default_rng(n)
    bank = rng.standard_normal((n, *extents)) * 10.0 ** rng.integers(-6, 6, (n, 1, 1, 1))
    shape = (33, 40, 70)
    mode = "constant" if dtype == np.uint8 else "reflect"
    cval, engine = split_case(dtype, mode)
    vol = volume_of(dtype, shape, n)
    conv = direct_convolver(bank, shape, dtype, mode, cval, device=nvidia, slab_depth=13,
                            engine="tensor")  # fmt: skip
    assert conv.engine == engine
    assert_spec_close(run(conv, vol), vol, bank, reference(vol, bank, mode, cval))


def test_split_nonfinite(nvidia):
    """NaN and Inf voxels of a float volume reach their outputs as in scipy; the finite part
    through the digits."""
    bank = np.random.default_rng(11).standard_normal((8, 3, 4, 5))
    shape = (20, 21, 22)
    vol = volume_of(np.float32, shape)
    vol[3, 4, 5], vol[10, 10, 10], vol[15, 2, 20] = np.nan, np.inf, -np.inf
    conv = direct_convolver(bank, shape, np.float32, "wrap", device=nvidia, slab_depth=6,
                            engine="tensor")  # fmt: skip
    out = run(conv, vol)
    assert_nonfinite_as_scipy(out, vol, bank, reference(vol, bank, "wrap"))


@pytest.mark.parametrize("dtype", [np.int16, np.float32])
def test_split_no_worse_than_fp32(nvidia, dtype):
    """Error against float64 (max |err| / (sum|w| x max|v|)) of the digits at most the FP32
    kernel's, for 8 random 7^3 filters."""
    bank = np.random.default_rng(6).standard_normal((8, 7, 7, 7))
    vol = volume_of(dtype, (48, 56, 64))
    ref = reference(vol, bank, "reflect")
    scale = np.abs(bank).sum(axis=(1, 2, 3)) * float(np.abs(vol).max())
    errs = {}
    for engine in ("tensor", "fp32"):
        out = run(direct_convolver(bank, vol.shape, dtype, device=nvidia, engine=engine), vol)
        errs[engine] = float((np.abs(out - ref).max(axis=(1, 2, 3)) / scale).max())
    assert errs["tensor"] <= errs["fp32"], errs


@pytest.mark.parametrize("k", [7, 9, 11])
def test_tensor_no_worse_than_fp32(nvidia, k):
    """Error against float64 (max |err| / (sum|w| x 255)) at most the FP32 kernel's, at every
    extent 'auto' gives the tensor cores (11^3: where the FP32 kernel sums each plane apart)."""
    bank = np.random.default_rng(6).standard_normal((8, k, k, k))
    vol = volume_of(np.uint8, (48, 56, 64))
    auto = direct_convolver(bank, vol.shape, np.uint8, device=nvidia)
    assert auto.engine == TENSOR_ENGINE
    ref = reference(vol, bank, "reflect")
    scale = np.abs(bank).sum(axis=(1, 2, 3)) * 255.0
    errs = {}
    for engine in ("tensor", "fp32"):
        out = run(direct_convolver(bank, vol.shape, np.uint8, device=nvidia, engine=engine), vol)
        errs[engine] = float((np.abs(out - ref).max(axis=(1, 2, 3)) / scale).max())
    assert errs["tensor"] <= errs["fp32"], errs


def test_record_holds_the_unit_peak():
    """Beside the FP32 peak: the tensor units' peak and the fraction the issued MMAs reached."""
    from volconv.device.peak import nvidia_tensor_peak
    from volconv.report import throughput

    h100 = nvidia_tensor_peak((9, 0), 132, 1830.0)
    assert h100.gflops == pytest.approx(989_400, rel=1e-3)  # the datasheet's dense FP16
    assert nvidia_tensor_peak((7, 5), 40, 1500.0).gflops is None
    r = throughput(92.0, 0.001, 0.01, 66_900.0, engine=TENSOR_ENGINE, unit_gflop=240.0,
                   unit_peak_gflops=h100.gflops)  # fmt: skip
    assert r["engine"] == TENSOR_ENGINE
    assert r["fraction_of_unit_peak"] == pytest.approx(240.0 / 0.001 / h100.gflops)
    plain = throughput(92.0, 0.001, 0.01, 66_900.0)
    assert np.isnan(plain["unit_peak_gflops"]) and np.isnan(plain["fraction_of_unit_peak"])


def test_the_tune_cache_holds_for_every_tensor_kernel_source():
    """A change to any kernel the tensor engine builds invalidates what was tuned with it: its
    MMA kernel (`TensorConvolver`), the digit split (`DigitConvolver`), and any tensor kernel
    in kernels/; every source named exists (`kernel_hash` reads them)."""
    (tensor,) = [e for e in ENGINES if e.name == "tensor"]
    assert KERNEL_FILE in tensor.sources and "digits.cl" in tensor.sources
    shipped = {p.name for p in kernel_folder().iterdir() if p.name.startswith("tensor")}
    assert KERNEL_FILE in shipped and shipped <= set(tensor.sources)
    assert len(kernel_hash()) == 12
