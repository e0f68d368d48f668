"""Moved to `planner.testing` (test references need torch; the compiler must not). Kept so
that the tests, the demo and the benchmarks that import from here keep working."""

from planner.testing import DTYPES, logical_box, materialize, piece_view, random_full_tensors

__all__ = ["DTYPES", "logical_box", "materialize", "piece_view", "random_full_tensors"]
