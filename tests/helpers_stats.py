"""Statistical checks shared by the distribution tests."""

from __future__ import annotations

import collections
from collections.abc import Sequence


def same_distribution_pvalue(a: Sequence[tuple], b: Sequence[tuple], pos: int) -> float:
    """Two-sample chi-square p-value that token ``pos`` of outputs ``a`` and of outputs ``b``
    come from one distribution."""
    from scipy.stats import chi2_contingency

    ca = collections.Counter(x[pos] for x in a)
    cb = collections.Counter(x[pos] for x in b)
    keys = sorted(set(ca) | set(cb))
    return chi2_contingency([[ca[k] for k in keys], [cb[k] for k in keys]])[1]
