"""Summary statistics shared by the ceiling, the load generator, the reports and the plot."""

from __future__ import annotations

import numpy as np


def percentile(values, q: float) -> float | None:
    """The q-th percentile (linear interpolation); None when there is nothing to summarise,
    so an empty level shows as '-' instead of failing the whole report."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def median(values) -> float | None:
    return percentile(values, 50)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds, None staying None."""
    return None if seconds is None else seconds * 1e3
