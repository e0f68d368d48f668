"""Hypothesis profiles of the property suite.

- `fast` (default; CI): few examples per property, the whole suite in well under 3 minutes
  on a 2-core machine.
- `deep` (`pytest --hypothesis-profile=deep tests/property`): 1000 examples per property
  (166 for the cross-process one), no deadline: about 40 minutes on the 2-core CI box;
  run it before a release (docs/properties.md records the runs).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, derandomize=False, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                      HealthCheck.data_too_large])
settings.register_profile("fast", max_examples=12, **_COMMON)
settings.register_profile("deep", max_examples=1000, **_COMMON)


def pytest_configure(config: pytest.Config) -> None:
    # Runs whether this conftest is loaded at start-up (`pytest tests/property`) or during
    # collection (`pytest tests`): `--hypothesis-profile` wins, else `fast`.
    settings.load_profile(config.getoption("hypothesis_profile", None) or "fast")
