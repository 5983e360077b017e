"""Weighted averaging against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from fedvlm.strategies.aggregation import weighted_average


def test_weighted_average_by_hand():
    a = {"ctx": np.array([[1.0, 2.0]], dtype=np.float32), "b": np.array([0.0], dtype=np.float32)}
    b = {"ctx": np.array([[3.0, 6.0]], dtype=np.float32), "b": np.array([4.0], dtype=np.float32)}
    out = weighted_average([a, b], [1, 3])
    np.testing.assert_allclose(out["ctx"], [[2.5, 5.0]])  # (1*1 + 3*3)/4, (2*1 + 6*3)/4
    np.testing.assert_allclose(out["b"], [3.0])
    assert out["ctx"].dtype == np.float32


def test_weighted_average_rejects_bad_input():
    a = {"x": np.ones(2)}
    with pytest.raises(ValueError):
        weighted_average([a], [0])
    with pytest.raises(ValueError):
        weighted_average([a, {"y": np.ones(2)}], [1, 1])
    with pytest.raises(ValueError):
        weighted_average([], [])
