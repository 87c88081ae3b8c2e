import math

import pytest

from chi_square import chi2_sf


@pytest.mark.parametrize("x,df,expected", [
    # closed forms: df=2 -> exp(-x/2); df=1 -> erfc(sqrt(x/2)); df=4 -> exp(-x/2)(1 + x/2)
    (3.0, 2, math.exp(-1.5)), (40.0, 2, math.exp(-20)),
    (0.5, 1, math.erfc(math.sqrt(0.25))), (9.0, 1, math.erfc(math.sqrt(4.5))),
    (2.0, 4, math.exp(-1) * 2), (30.0, 4, math.exp(-15) * 16),
])
def test_chi2_sf_matches_closed_forms(x, df, expected):
    assert chi2_sf(x, df) == pytest.approx(expected, rel=1e-9)
