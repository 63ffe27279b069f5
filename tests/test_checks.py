"""volconv.checks: the shared checks, hints and the contract's tolerance."""

from __future__ import annotations

import numpy as np
import pytest

from volconv.checks import (
    check_cval,
    check_mode,
    check_positive_int,
    closest,
    spec_tolerance,
    suggest,
)


def test_closest_and_suggest():
    assert closest("devise", ["device", "slab_depth"]) == "device"
    assert closest("zzz", ["device"]) is None
    assert suggest("devise", ["device"], "run.") == "did you mean run.device?"
    assert suggest("zzz", ["a", "b"]) == "valid: a, b"


def test_mode_cval_and_integers_name_the_parameter():
    assert check_mode("wrap") == "wrap"
    with pytest.raises(ValueError, match=r"^bank.boundary must be one of"):
        check_mode("warp", "bank.boundary")
    assert check_cval(np.float32(2)) == 2.0
    with pytest.raises(TypeError, match="cval"):
        check_cval("x")
    with pytest.raises(TypeError, match="cval"):
        check_cval(True)
    with pytest.raises(ValueError, match="cval must be finite"):
        check_cval(float("nan"))
    assert check_positive_int(np.int64(3), "slab_depth") == 3
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="slab_depth must be a positive integer"):
            check_positive_int(bad, "slab_depth")


def test_spec_tolerance():
    k = np.full((3, 3, 3), -0.5)
    assert spec_tolerance(k, 255) == pytest.approx(1e-5 * 13.5 * 255 + 1e-6)
