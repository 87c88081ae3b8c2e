"""Chi-square survival function (scipy is not a dependency): Q(df/2, x/2), the regularised upper
incomplete gamma function, by its series or its continued fraction (Numerical Recipes, §6.2)."""

import math


def chi2_sf(x: float, df: int) -> float:
    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:
        return 1.0 - _lower_series(a, z)
    return _upper_fraction(a, z)


def _lower_series(a: float, z: float) -> float:
    term = total = 1.0 / a
    n = a
    while abs(term) > abs(total) * 1e-15:
        n += 1
        term *= z / n
        total += term
    return total * math.exp(-z + a * math.log(z) - math.lgamma(a))


def _upper_fraction(a: float, z: float) -> float:
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h
