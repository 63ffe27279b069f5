"""The filter library: generated banks through the engine against scipy.ndimage's own filters."""

from __future__ import annotations

import warnings

import nibabel as nib
import numpy as np
import pytest
import scipy.ndimage as ndi
from conftest import assert_spec_close, reference
from typer.testing import CliRunner

from volconv.bank.filters import FILTER_TYPES, Filter, build_bank, stack_kernels
from volconv.bank.kernels import gaussian_kernel1d
from volconv.bank.spec import BankError, TruncationWarning
from volconv.commands import app
from volconv.engines.direct import convolve_bank

RNG = np.random.default_rng(3)
VOLUME = (RNG.standard_normal((12, 13, 14)) * 20).astype(np.float32)


def convolve(volume, filters, mode, cval, device):
    # One vector width for every bank keeps the PoCL compiles (one per extent and width) few.
    return convolve_bank(volume, stack_kernels(filters), mode, cval, device=device, vector_width=4)


def along_axes(volume, sigma, order, size, mode, cval=0.0):
    """gaussian_filter where sigma, order or size differ per axis: one 1D pass per axis."""
    out = np.asarray(volume, np.float64)
    for axis, (s, o, k) in enumerate(zip(sigma, order, size, strict=True)):
        out = ndi.gaussian_filter1d(out, s, axis, o, mode=mode, cval=cval, truncate=(k // 2) / s)
    return out


# -- Gaussian kernels are scipy's ---------------------------------------------------------


@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize(("sigma", "radius"), [(0.6, 3), (1.5, 2), (2.0, 8), (4.0, 1)])
def test_gaussian_kernel1d_is_scipys_impulse_response(sigma, order, radius):
    impulse = np.zeros(2 * radius + 1)
    impulse[radius] = 1.0
    scipy_kernel = ndi.gaussian_filter1d(
        impulse, sigma, order=order, mode="constant", truncate=radius / sigma
    )
    np.testing.assert_allclose(gaussian_kernel1d(sigma, order, radius), scipy_kernel, atol=1e-15)


# -- generated banks on the device against scipy ------------------------------------------

MIXED = [
    {"name": "smooth", "type": "gaussian", "sigma": 1.2},
    {"type": "gaussian", "sigma": 0.8, "order": [1, 0, 0]},
    {"type": "gaussian", "sigma": 1.0, "order": [0, 2, 1]},
    {"type": "log", "sigma": 1.1},
    {"type": "dog", "sigma": 0.7},
    {"type": "box"},
    {"type": "box", "size": [1, 3, 5]},
    {"type": "sobel", "axis": 2},
]


def mixed_scipy(v, mode, cval):
    """Each filter of MIXED by scipy's own function, or None where scipy's separable passes
    differ from a 3D convolution (derivatives in constant mode with cval != 0)."""
    v = np.asarray(v, np.float64)
    kw = {"mode": mode, "cval": cval}
    smooth = mode != "constant" or cval == 0
    return [
        ndi.gaussian_filter(v, 1.2, truncate=2 / 1.2, **kw),
        ndi.gaussian_filter(v, 0.8, order=[1, 0, 0], truncate=2 / 0.8, **kw) if smooth else None,
        ndi.gaussian_filter(v, 1.0, order=[0, 2, 1], truncate=2 / 1.0, **kw) if smooth else None,
        ndi.gaussian_laplace(v, 1.1, truncate=2 / 1.1, **kw) if smooth else None,
        ndi.gaussian_filter(v, 0.7, truncate=2 / 0.7, **kw)
        - ndi.gaussian_filter(v, 1.6 * 0.7, truncate=2 / (1.6 * 0.7), **kw),
        ndi.uniform_filter(v, 5, **kw),
        ndi.uniform_filter(v, [1, 3, 5], **kw),
        ndi.sobel(v, 2, **kw) if smooth else None,
    ]


@pytest.mark.parametrize(
    ("mode", "cval", "dtype"),
    [
        ("reflect", 0.0, "float32"),
        ("mirror", 0.0, "float32"),
        ("nearest", 0.0, "float32"),
        ("wrap", 0.0, "float32"),
        ("constant", 0.0, "float32"),
        ("constant", 2.5, "float32"),
        ("reflect", 0.0, "uint8"),
    ],
)
def test_generated_filters_equal_scipys(device, mode, cval, dtype):
    v = VOLUME if dtype == "float32" else RNG.integers(0, 256, VOLUME.shape).astype(np.uint8)
    filters = build_bank(MIXED, size=5)
    assert [f.type for f in filters] == [s["type"] for s in MIXED]
    out = convolve(v, filters, mode, cval, device)
    compared = 0
    for i, (f, ref) in enumerate(zip(filters, mixed_scipy(v, mode, cval), strict=True)):
        if ref is not None:
            assert_spec_close(out[i : i + 1], v, f.kernel[None], ref[None])
            compared += 1
    assert compared >= 4


ANISOTROPIC = [
    {"type": "gaussian", "sigma": [1.0, 2.0, 0.7], "size": [3, 5, 7]},
    {"type": "gaussian", "sigma": [0.9, 1.3, 1.7], "order": [0, 1, 2], "size": [5, 5, 7]},
    {"type": "gaussian", "sigma": 2.0, "units": "mm"},  # voxels (2, 1, 4)
    {"type": "gaussian", "sigma": [1.0, 2.0, 1.0], "order": [1, 1, 0], "units": "mm"},
    {"type": "log", "sigma": [1.0, 1.5, 2.0], "units": "mm"},
    {"type": "dog", "sigma": [1.0, 2.0, 0.5], "sigma2": 3.0, "units": "mm"},
]
VOXEL_SIZE = (1.0, 2.0, 0.5)


@pytest.mark.parametrize(("mode", "cval"), [("reflect", 0.0), ("constant", 0.0), ("wrap", 0.0)])
def test_anisotropic_sigma_and_mm_units_equal_scipy(device, mode, cval):
    filters = build_bank(ANISOTROPIC, size=[5, 3, 7], voxel_size=VOXEL_SIZE)
    v = VOLUME
    mm = np.array(VOXEL_SIZE)
    log_sigma = np.array([1.0, 1.5, 2.0]) / mm
    refs = [
        along_axes(v, [1.0, 2.0, 0.7], [0, 0, 0], [3, 5, 7], mode, cval),
        along_axes(v, [0.9, 1.3, 1.7], [0, 1, 2], [5, 5, 7], mode, cval),
        along_axes(v, [2.0, 1.0, 4.0], [0, 0, 0], [5, 3, 7], mode, cval),
        along_axes(v, [1.0, 1.0, 2.0], [1, 1, 0], [5, 3, 7], mode, cval),
        # gaussian_laplace takes one truncate; radius gives the extent per axis
        ndi.gaussian_laplace(
            v.astype(np.float64), log_sigma, mode=mode, cval=cval, radius=[2, 1, 3]
        ),
        along_axes(v, [1.0, 1.0, 1.0], [0, 0, 0], [5, 3, 7], mode, cval)
        - along_axes(v, 3.0 / mm, [0, 0, 0], [5, 3, 7], mode, cval),
    ]
    out = convolve(v, filters, mode, cval, device)
    assert_spec_close(out, v, stack_kernels(filters), np.stack(refs))


# -- stack_kernels ------------------------------------------------------------------------

EXTENTS = [(4, 5, 2), (3, 3, 3), (1, 6, 1), (2, 1, 5), (5, 2, 4)]


def random_filters(extents):
    return [Filter(f"k{i}", "custom", RNG.standard_normal(e)) for i, e in enumerate(extents)]


def test_stack_kernels_pads_to_the_smallest_extent_keeping_centres():
    filters = random_filters(EXTENTS)
    stacked = stack_kernels(filters)
    # taps before / after the centre (k // 2 and k - 1 - k // 2): axis 0 2/2, 1 3/2, 2 2/2
    assert stacked.shape == (5, 5, 6, 5)
    v = RNG.standard_normal((9, 10, 11))
    for f, padded in zip(filters, stacked, strict=True):
        np.testing.assert_array_equal(np.sort(padded[padded != 0]), np.sort(f.kernel.ravel()))
        for mode in ("reflect", "constant", "wrap"):
            np.testing.assert_allclose(
                ndi.convolve(v, padded, mode=mode, cval=1.5),
                ndi.convolve(v, f.kernel, mode=mode, cval=1.5),
                rtol=1e-12,
                atol=1e-12,
            )


@pytest.mark.parametrize("extent", [(4, 2, 6), (1, 1, 1), (3, 5, 7)])
def test_stack_of_one_kernel_is_that_kernel(extent):
    (f,) = random_filters([extent])
    np.testing.assert_array_equal(stack_kernels([f])[0], f.kernel)


def test_stacked_mixed_extents_on_the_device(device):
    filters = random_filters(EXTENTS)
    out = convolve(VOLUME, filters, "mirror", 0.0, device)
    v = VOLUME.astype(np.float64)
    ref = np.stack([ndi.convolve(v, f.kernel, mode="mirror") for f in filters])
    assert_spec_close(out, VOLUME, stack_kernels(filters), ref)


# -- gabor --------------------------------------------------------------------------------


def test_gabor_pair_is_zero_mean_with_even_real_and_odd_imaginary_part():
    real, imag = build_bank(
        [{"name": "g", "type": "gabor", "sigma": 2, "frequency": 0.15, "orientation": [30, 20]}],
        size=9,
    )
    assert (real.name, imag.name) == ("g_real", "g_imag")
    assert abs(real.kernel.sum()) < 1e-15 and abs(imag.kernel.sum()) < 1e-15
    np.testing.assert_allclose(real.kernel, real.kernel[::-1, ::-1, ::-1], atol=1e-17)
    np.testing.assert_allclose(imag.kernel, -imag.kernel[::-1, ::-1, ::-1], atol=1e-17)


def test_gabor_in_mm_follows_the_documented_formula():
    """Envelope and wave evaluated at physical positions (mm), then Morlet's zero-DC term."""
    spec = {
        "type": "gabor",
        "sigma": [2, 3, 1.5],
        "frequency": 0.1,
        "orientation": [60, -30],
        "phase": 40,
        "units": "mm",
        "size": [7, 5, 9],
    }
    real, imag = build_bank([spec], voxel_size=VOXEL_SIZE)
    p = np.meshgrid(
        *[
            np.arange(-(k // 2), k // 2 + 1) * s
            for k, s in zip(spec["size"], VOXEL_SIZE, strict=True)
        ],
        indexing="ij",
    )
    env = np.exp(-0.5 * sum((pa / sa) ** 2 for pa, sa in zip(p, spec["sigma"], strict=True)))
    env /= env.sum()
    az, el = np.deg2rad(spec["orientation"])
    u = [np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)]
    theta = 2 * np.pi * 0.1 * sum(pa * ua for pa, ua in zip(p, u, strict=True)) + np.deg2rad(40)
    for part, wave in ((real, np.cos(theta)), (imag, np.sin(theta))):
        expected = env * wave - np.sum(env * wave) * env
        np.testing.assert_allclose(part.kernel, expected, atol=1e-15)


def test_gabor_responds_to_its_own_wave():
    """|response| to a plane wave along the filter's orientation is the amplitude of the wave's
    matching complex component (1/2), across it nearly nothing."""
    x = np.indices((25, 25, 25)).astype(np.float64)
    wave = np.cos(2 * np.pi * 0.2 * x[1])  # varies along axis 1 (azimuth 90)

    def energy(orientation):
        real, imag = build_bank(
            [{"type": "gabor", "sigma": 3, "frequency": 0.2, "orientation": orientation}], size=13
        )
        r, i = (ndi.convolve(wave, k.kernel, mode="wrap")[12, 12, 12] for k in (real, imag))
        return np.hypot(r, i)

    assert abs(energy([90, 0]) - 0.5) < 0.01
    assert energy([0, 0]) < 0.01 and energy([90, 90]) < 0.01


def test_gabor_on_the_device(device):
    filters = build_bank(
        [{"type": "gabor", "sigma": 1.5, "frequency": 0.25, "orientation": [45, 10]}], size=5
    )
    kernels = stack_kernels(filters)
    out = convolve(VOLUME, filters, "nearest", 0.0, device)
    assert_spec_close(out, VOLUME, kernels, reference(VOLUME, kernels, "nearest"))


# -- custom kernels, names ------------------------------------------------------------------


def test_custom_kernels_from_npy_and_nifti(tmp_path):
    a = RNG.standard_normal((4, 2, 3))
    b = RNG.standard_normal((3, 1, 5)).astype(np.float32)
    (tmp_path / "k").mkdir()
    np.save(tmp_path / "k" / "a.npy", a)
    nib.save(nib.Nifti1Image(b, np.eye(4)), tmp_path / "k" / "b.nii.gz")
    filters = build_bank(
        [
            {"type": "custom", "path": "k/a.npy"},
            {"name": "b", "type": "custom", "path": "k/b.nii.gz"},
        ],
        base_dir=tmp_path,
    )
    assert [f.name for f in filters] == ["custom_0", "b"]
    np.testing.assert_array_equal(filters[0].kernel, a)
    np.testing.assert_array_equal(filters[1].kernel, b)
    assert filters[1].kernel.dtype == np.float64 and not filters[1].kernel.flags.writeable


def test_default_names_follow_the_position_in_the_list():
    specs = [
        {"type": "box"},
        {"name": "mine", "type": "sobel", "axis": 0},
        {"type": "gabor", "sigma": 1, "frequency": 0.3},
    ]
    assert [f.name for f in build_bank(specs, size=3)] == [
        "box_0",
        "mine",
        "gabor_2_real",
        "gabor_2_imag",
    ]


# -- every bad spec names its key -----------------------------------------------------------

G = {"type": "gaussian", "sigma": 1.0}


def bad(**changes):
    return [{**G, **changes}]


BAD = [
    ([], {}, "bank.filter: the bank is empty"),
    ({"type": "box"}, {}, "bank.filter: must be an array of tables"),
    ([3], {}, "bank.filter[0]: must be a table; got 3"),
    ([{"sigma": 1}], {}, "bank.filter[0].type: missing; one of gaussian"),
    (
        bad(type="gausian"),
        {},
        "bank.filter[0].type: unknown filter type \"gausian\"; did you mean 'gaussian'?",
    ),
    (
        bad(sigam=2),
        {},
        "bank.filter[0].sigam: unknown key for a gaussian filter; did you mean 'sigma'?",
    ),
    (
        [G, {"type": "box", "sigma": 1}],
        {},
        "bank.filter[1].sigma: unknown key for a box filter; one of name, type, size",
    ),
    ([{"type": "log"}], {}, "bank.filter[0].sigma: missing"),
    (bad(sigma=-1), {}, "bank.filter[0].sigma: must be > 0; got -1"),
    (bad(sigma=[1, 0, 1]), {}, "bank.filter[0].sigma: must be > 0; got [1, 0, 1]"),
    (bad(sigma=[1, 2]), {}, "bank.filter[0].sigma: must be a number or a list of 3"),
    (
        bad(sigma=True),
        {},
        "bank.filter[0].sigma: must be a number or a list of 3 (one per axis); got true",
    ),
    (
        bad(sigma="1"),
        {},
        'bank.filter[0].sigma: must be a number or a list of 3 (one per axis); got "1"',
    ),
    (bad(order=3), {}, "bank.filter[0].order: must be 0..2; got 3"),
    (bad(order=0.5), {}, "bank.filter[0].order: must be an integer or a list of 3"),
    (bad(size=4), {}, "bank.filter[0].size: must be odd and 1..31 per axis; got 4"),
    (
        bad(size=[3, 33, 3]),
        {},
        "bank.filter[0].size: must be odd and 1..31 per axis; got [3, 33, 3]",
    ),
    (bad(size=0), {}, "bank.filter[0].size: must be odd and 1..31 per axis; got 0"),
    ([G], {"size": 8}, "bank.size: must be odd and 1..31 per axis; got 8"),
    (bad(units="cm"), {}, 'bank.filter[0].units: unknown units "cm"; one of voxels, mm'),
    (
        bad(units="mm"),
        {"voxel_size": (1, 0, 1)},
        'bank.filter[0].units: "mm" needs the voxel size',
    ),
    (bad(name=""), {}, 'bank.filter[0].name: must be a non-empty string; got ""'),
    (
        [G, {**G, "name": "gaussian_0"}],
        {},
        "bank.filter[1].name: duplicate filter name 'gaussian_0' (also bank.filter[0])",
    ),
    (
        [{"type": "gabor", "name": "g", "sigma": 1, "frequency": 0.1}, {**G, "name": "g_imag"}],
        {},
        "bank.filter[1].name: duplicate filter name 'g_imag'",
    ),
    (
        [{"type": "dog", "sigma": 2, "sigma2": -3}],
        {},
        "bank.filter[0].sigma2: must be > 0; got -3",
    ),
    (
        [{"type": "dog", "sigma": 2, "sigma2": 2}],
        {},
        "bank.filter[0].sigma2: must be different from sigma",
    ),
    ([{"type": "sobel", "axis": 3}], {}, "bank.filter[0].axis: must be 0, 1 or 2; got 3"),
    (
        [{"type": "sobel", "axis": 0, "size": 5}],
        {},
        "bank.filter[0].size: unknown key for a sobel filter",
    ),
    (
        [{"type": "gabor", "sigma": 1, "frequency": 0.6}],
        {},
        "bank.filter[0].frequency: must be in (0, 0.5] cycles per voxel; got 0.6",
    ),
    (
        [{"type": "gabor", "sigma": 1, "frequency": 0}],
        {},
        "bank.filter[0].frequency: must be in (0, 0.5]",
    ),
    (
        [{"type": "gabor", "sigma": 1, "frequency": 0.3, "units": "mm"}],
        {"voxel_size": (1, 2, 1)},
        "bank.filter[0].frequency: must be in (0, 0.25] cycles per mm; got 0.3",
    ),
    (
        [{"type": "gabor", "sigma": 1, "frequency": 0.1, "orientation": [10]}],
        {},
        "bank.filter[0].orientation: must be [azimuth, elevation] in degrees; got [10]",
    ),
    (
        [{"type": "gabor", "sigma": 1, "frequncy": 0.1}],
        {},
        "bank.filter[0].frequncy: unknown key for a gabor filter; did you mean 'frequency'?",
    ),
    # a sigma so small (or with order 2 so small) that the kernel is not finite in float32
    (bad(sigma=1e-300), {}, "bank.filter[0].sigma: must be large enough for a kernel that is"),
    (bad(sigma=1e-155, order=2), {}, "bank.filter[0].sigma: must be large enough; got 1e-155"),
    (bad(sigma=[1, 1e-30, 1], order=[0, 2, 0]), {}, "bank.filter[0].sigma: must be large"),
    ([{"type": "log", "sigma": 1e-200}], {}, "bank.filter[0].sigma: must be large enough"),
    ([{"type": "dog", "sigma": 1, "sigma2": 1e-300}], {}, "bank.filter[0].sigma2: must be large"),
    ([{"type": "custom"}], {}, "bank.filter[0].path: missing"),
    ([{"type": "custom", "path": "nope.npy"}], {}, "bank.filter[0].path: no such file"),
]


@pytest.mark.parametrize(("specs", "kwargs", "message"), BAD)
def test_bad_specs_name_the_key_and_value(specs, kwargs, message):
    with warnings.catch_warnings(), pytest.raises(BankError) as info:
        warnings.simplefilter("error")  # one message, no numpy RuntimeWarning before it
        build_bank(specs, **kwargs)
    start, _, end = message.partition("; got ")  # "...; got VALUE" checks the value too
    assert str(info.value).startswith(start), str(info.value)
    assert str(info.value).endswith(f"; got {end}" if end else ""), str(info.value)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [("k.npy", np.zeros((3, 3)), "must hold a 3D array of extents 1..31; got shape (3, 3)"),
     ("k.npy", np.zeros((3, 32, 3)), "must hold a 3D array of extents 1..31; got shape (3, 32, 3)"),
     ("k.npy", np.full((3, 3, 3), np.nan), "holds NaN or infinite values"),
     ("k.npy", np.full((3, 3, 3), 1e300), "holds values beyond float32's range"),
     ("k.npy", np.zeros((3, 3, 3), complex), "must hold real numbers; got dtype complex128"),
     ("k.npy", b"not an array", "cannot read"),
     ("k.nii", b"not an image", "cannot read")],
)  # fmt: skip
def test_bad_custom_files_name_the_key_and_file(tmp_path, name, content, message):
    if isinstance(content, np.ndarray):
        np.save(tmp_path / name, content)
    else:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(BankError) as info:
        build_bank([{"type": "custom", "path": name}], base_dir=tmp_path)
    text = str(info.value)
    assert text.startswith("bank.filter[0].path: "), text
    assert str(tmp_path / name) in text and message in text, text


# -- volconv filters ------------------------------------------------------------------------


def test_cli_lists_every_type_with_its_parameters_and_defaults():
    result = CliRunner().invoke(app, ["filters"])
    assert result.exit_code == 0, result.output
    for name, ftype in FILTER_TYPES.items():
        assert f"{name}: {ftype.doc}" in result.output
        for key in ftype.params:
            assert key in result.output
    assert "1.6 * sigma" in result.output and "required" in result.output


def test_a_gaussian_cut_to_a_box_warns_naming_the_filter_and_the_cut():
    """sigma 10 at size 3 is a box, not the Gaussian asked for: a warning says so and which
    size would reach 3 sigma; well-sized Gaussians are silent."""
    with pytest.warns(TruncationWarning) as caught:
        build_bank([{"type": "gaussian", "sigma": 10, "size": 3}])
    (message,) = [str(w.message) for w in caught]
    assert message.startswith("bank.filter[0] (gaussian_0): size 3 truncates the Gaussian")
    assert "sigma 10 at 0.1 sigma" in message and "use size >= 61" in message
    with pytest.warns(TruncationWarning, match=r"bank.filter\[1\].*sigma2.*use size >= 21"):
        build_bank([{"type": "box"}, {"type": "dog", "sigma": 2, "size": 5}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_bank([{"type": "gaussian", "sigma": 1.5, "size": 7},
                    {"type": "log", "sigma": [1, 1, 4], "size": [3, 3, 1]}], 7)  # fmt: skip


def test_mm_without_the_inputs_voxel_size_names_the_key():
    """units = "mm" where the input records no voxel size is refused, naming the key that
    asked for mm: the bank's, or the filter's own."""
    why = "a .npy file records no voxel size"
    with pytest.raises(BankError, match=r'^bank.units: "mm" needs the input\'s voxel size, and a'):
        build_bank([{"type": "gaussian", "sigma": 1}], units="mm", voxel_unknown=why)
    with pytest.raises(BankError, match=r"^bank.filter\[1\].units: "):
        build_bank([{"type": "box"}, {"type": "log", "sigma": 1, "units": "mm"}],
                   voxel_unknown=why)  # fmt: skip
    build_bank([{"type": "gaussian", "sigma": 1}], voxel_unknown=why)  # voxels: no matter
