"""Oracle: SGLang 0.5.23's own EPLB rearrangement (`update_expert_weights_single_layer`, its
P2P over gloo on CPU) of the stacked experts a refit with plan A wrote equals, bit for bit,
what the plan replanned for the new placement writes (`sglang_eplb_worker.py`)."""

from __future__ import annotations

import pytest

from tests.oracles.launch import launch
from tests.support import oracles

pytestmark = pytest.mark.oracle
oracles.require("sglang")


def test_sglang_eplb_rearrangement_equals_the_replanned_refit() -> None:
    launch("sglang_eplb_worker.py", 2, {}, quiet_s=60.0)
