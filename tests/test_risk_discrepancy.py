"""The four discrepancies: each axis responds to its own change; missing objects; grid mismatches."""
from __future__ import annotations

import math

import numpy as np
import pytest

from carnator.carnator_core.risk.discrepancy import AXES, SignatureMismatchError, discrepancies
from carnator.carnator_core.types import ObjectSignature, Signature

GRID = (4, 8, 8)


def box_mask(t0=0, t1=4, y0=2, y1=5, x0=2, x1=5, grid=GRID) -> np.ndarray:
    m = np.zeros(grid, np.float32)
    m[t0:t1, y0:y1, x0:x1] = 1.0
    return m


def obj(name="dog", mask=None, lab=(50.0, 20.0, 30.0), size=None) -> ObjectSignature:
    mask = box_mask() if mask is None else mask
    return ObjectSignature(name=name, mask=mask, size=float(mask.mean()) if size is None else size, lab=lab)


def sig(*objects: ObjectSignature, context=(60.0, 0.0, 10.0), grid=GRID, ctx_shape=(3, 3)) -> Signature:
    ctx = np.broadcast_to(np.array(context, np.float32), ctx_shape + (3,)).copy()
    return Signature(objects=tuple(objects), context_lab=ctx, grid=grid)


def test_identical_signatures_are_zero():
    a = sig(obj("dog"), obj("ball", box_mask(y0=5, y1=7, x0=5, x1=7), lab=(70, -10, 40)))
    d = discrepancies(a, a)
    assert d.vector() == (0.0, 0.0, 0.0, 0.0)
    assert not d.missing
    assert [o.name for o in d.objects] == ["dog", "ball"]


def test_ciede2000_reference_value():
    # Sharma, Wu & Dalal (2005) CIEDE2000 test data, pair 1: ΔE00 = 2.0425.
    a = sig(context=(50.0, 2.6772, -79.7751), ctx_shape=(1, 1))
    b = sig(context=(50.0, 0.0, -82.7485), ctx_shape=(1, 1))
    assert discrepancies(a, b).context == pytest.approx(2.0425, abs=1e-4)


@pytest.mark.parametrize("axis", AXES)
def test_each_axis_responds_to_its_own_change_monotonically(axis):
    base = sig(obj("dog"))

    def changed(amount: float) -> Signature:
        if axis == "context":
            return sig(obj("dog"), context=(60.0 - 20 * amount, 0.0 + 30 * amount, 10.0))
        if axis == "size":  # same mask (shape), different reported size
            return sig(obj("dog", size=float(box_mask().mean()) * (1.0 + 3 * amount)))
        if axis == "shape":  # same mass, shifted support
            shift = int(round(3 * amount))
            return sig(obj("dog", mask=box_mask(x0=2 + shift, x1=5 + shift)))
        return sig(obj("dog", lab=(50.0, 20.0 + 40 * amount, 30.0 - 30 * amount)))

    values = []
    for amount in (0.0, 1 / 3, 2 / 3, 1.0):
        d = discrepancies(base, changed(amount)).as_dict()
        values.append(d[axis])
        for other in AXES:
            if other != axis:
                assert d[other] == pytest.approx(0.0, abs=1e-9), (axis, other, d)
    assert values[0] == pytest.approx(0.0, abs=1e-9)
    assert all(b > a for a, b in zip(values, values[1:])), values


def test_size_is_abs_log_ratio_with_one_cell_epsilon():
    n = int(np.prod(GRID))
    a = sig(obj("dog", size=0.2))
    b = sig(obj("dog", size=0.05))
    eps = 1.0 / n
    assert discrepancies(a, b).size == pytest.approx(abs(math.log((0.2 + eps) / (0.05 + eps))))
    assert discrepancies(a, b).size == pytest.approx(discrepancies(b, a).size)  # symmetric
    # an empty mask stays finite
    empty = sig(obj("dog", mask=np.zeros(GRID, np.float32), size=0.0))
    assert math.isfinite(discrepancies(a, empty).size)


def test_shape_is_one_minus_soft_iou():
    m1 = np.zeros(GRID, np.float32)
    m2 = np.zeros(GRID, np.float32)
    m1[0, 0, 0:4] = [1.0, 0.5, 0.0, 0.2]
    m2[0, 0, 0:4] = [0.5, 0.5, 1.0, 0.0]
    # sum min = 0.5 + 0.5 + 0 + 0 = 1.0; sum max = 1 + 0.5 + 1 + 0.2 = 2.7
    d = discrepancies(sig(obj("dog", mask=m1, size=0.1)), sig(obj("dog", mask=m2, size=0.1)))
    assert d.shape == pytest.approx(1.0 - 1.0 / 2.7)
    both_empty = discrepancies(
        sig(obj("dog", mask=np.zeros(GRID, np.float32))), sig(obj("dog", mask=np.zeros(GRID, np.float32)))
    )
    assert both_empty.shape == 0.0


def test_worst_object_per_axis():
    t = sig(obj("dog", lab=(50, 20, 30)), obj("ball", box_mask(y0=5, y1=7, x0=5, x1=7), lab=(70, -10, 40)))
    c = sig(
        obj("dog", lab=(50, 60, 0)),  # big colour change on the dog
        obj("ball", box_mask(y0=5, y1=7, x0=1, x1=3), lab=(70, -10, 40)),  # moved ball
    )
    d = discrepancies(t, c)
    assert d.worst_object("appearance") == "dog"
    assert d.worst_object("shape") == "ball"
    per = {o.name: o for o in d.objects}
    assert d.appearance == per["dog"].appearance > per["ball"].appearance
    assert d.shape == per["ball"].shape > per["dog"].shape


def test_missing_object_on_either_side():
    t = sig(obj("dog"), obj("ball", lab=(70, -10, 40)))
    c = sig(obj("Dog "), obj("cat"))  # name matching ignores case and surrounding space
    d = discrepancies(t, c)
    assert d.missing
    assert set(d.missing_objects) == {"ball (target only)", "cat (candidate only)"}
    assert [o.name for o in d.objects] == ["dog"]


def test_duplicate_names_match_in_order_and_surplus_is_missing():
    t = sig(obj("dog"), obj("dog", box_mask(y0=5, y1=7)))
    c = sig(obj("dog"))
    d = discrepancies(t, c)
    assert d.missing_objects == ("dog (target only)",)


def test_context_only_signatures():
    d = discrepancies(sig(), sig(context=(40.0, 10.0, 10.0)))
    assert d.size == d.shape == d.appearance == 0.0
    assert d.context > 0 and not d.missing


def test_grid_mismatch_raises_clear_error():
    with pytest.raises(SignatureMismatchError, match="token grids differ"):
        discrepancies(sig(obj()), sig(obj(mask=box_mask(grid=(4, 8, 16))), grid=(4, 8, 16)))
    with pytest.raises(SignatureMismatchError, match="mask grids differ"):
        discrepancies(sig(obj()), sig(obj(mask=box_mask(grid=(4, 8, 16)))))
    with pytest.raises(SignatureMismatchError, match="context grids differ"):
        discrepancies(sig(obj()), sig(obj(), ctx_shape=(4, 4)))


def test_inputs_are_not_modified_and_nan_is_refused():
    m = box_mask() * 1.5  # out of [0, 1]: clipped internally, not in place
    a = sig(obj("dog", mask=m))
    before = a.objects[0].mask.copy()
    discrepancies(a, sig(obj("dog")))
    assert np.array_equal(a.objects[0].mask, before)
    bad = sig(obj("dog", lab=(float("nan"), 0, 0)))
    with pytest.raises(ValueError, match="NaN"):
        discrepancies(sig(obj("dog")), bad)
