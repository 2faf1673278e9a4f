"""The one percentile: numpy's default definition, in pure Python."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.stats import percentile


def test_percentiles_interpolate_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    # rank = q/100 * (n - 1) over the sorted values 1, 2, 3, 4
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 95) is None
    with pytest.raises(ValueError, match=r"within 0\.\.100"):
        percentile(values, 191)


@given(
    values=st.lists(st.floats(-1e9, 1e9), min_size=1, max_size=60),
    q=st.floats(0, 100),
)
def test_it_is_numpys_percentile(values, q) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)
