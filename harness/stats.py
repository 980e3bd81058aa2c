"""
Student's t without scipy, for the harness's intervals over a few documents or seeds
(harness/decode_report.py, harness/gate_ablation.py).
"""
import math


def betainc(a, b, x):
    """The regularized incomplete beta I_x(a, b), by its continued fraction evaluated with Lentz's
    method (Numerical Recipes §6.4), to about 1e-14."""
    if x <= 0.0 or x >= 1.0:
        return float(x >= 1.0)
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a)
                     - math.lgamma(b)) / a
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(1000):
        m = i // 2
        num = (1.0 if i == 0 else m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)) if i % 2 == 0
               else -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)))
        d = 1.0 / (1.0 + num * d if abs(1.0 + num * d) > tiny else tiny)
        c = 1.0 + num / c if abs(1.0 + num / c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return front * (f - 1.0)


def t_cdf(t, dof):
    """P(T <= t) for Student's t with dof degrees of freedom."""
    tail = 0.5 * betainc(dof / 2, 0.5, dof / (dof + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p, dof):
    """The t with P(T <= t) = p (0 < p < 1), by bisection on t_cdf to 1e-12."""
    if p < 0.5:
        return -t_quantile(1.0 - p, dof)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, dof) < p:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, dof) < p else (lo, mid)
    return (lo + hi) / 2
