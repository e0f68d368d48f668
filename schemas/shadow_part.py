"""A target rank's shadow section as the plan file holds it (`RankPlan.shadow`): the columns
and the codec. Its meaning and rules: `schemas/shadow.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import PlanFormatError
from .table import Table

SHADOW_REGION_COLUMNS = (("region", "<i4"), ("offset", "<i8"), ("nbytes", "<i8"))
"""Bytes `[offset, offset + nbytes)` of a bound region that the plan writes."""
SWITCH_COLUMNS = (("chunk", "<i4"), ("region", "<i4"), ("offset", "<i8"), ("nbytes", "<i8"),
                  ("shadow_offset", "<i8"))
"""One switch op: copy `nbytes` bytes from the shadow (at `shadow_offset`) to the live
`region` at `offset`, in `chunk`."""
FIX = "the plan is corrupt or was tampered with: recompile it"


@dataclass(frozen=True, slots=True)
class ShadowPart:
    budget: int
    """0: a full shadow; else the bytes of a chunked shadow's one buffer."""
    regions: Table
    """`SHADOW_REGION_COLUMNS`."""
    switch: Table
    """`SWITCH_COLUMNS`, in chunk order."""

    @property
    def chunks(self) -> int:
        return int(self.switch["chunk"].max()) + 1 if len(self.switch) else 0

    @property
    def written_bytes(self) -> int:
        """Bytes the plan writes on this rank (what a switch copies)."""
        return int(self.regions["nbytes"].sum())

    @property
    def budget_used(self) -> int:
        """A chunked shadow's buffer as its chunks use it (the most any chunk reaches)."""
        s = self.switch
        return int((s["shadow_offset"] + s["nbytes"]).max()) if len(s) else 0

    def encode(self) -> dict[str, Any]:
        return {"budget": self.budget, "regions": self.regions.views(),
                "switch": self.switch.views()}

    @staticmethod
    def decode(raw: Any, what: str) -> ShadowPart:
        if not isinstance(raw, dict) or set(raw) != {"budget", "regions", "switch"}:
            raise PlanFormatError(f"{what}.shadow: is not a map of budget, regions, switch; {FIX}")
        b = raw["budget"]
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 1 << 62:
            raise PlanFormatError(f"{what}.shadow.budget = {str(b)[:40]!r} is not a byte count; "
                                  f"{FIX}")
        return ShadowPart(b, Table.from_msgpack(SHADOW_REGION_COLUMNS, raw["regions"],
                                                what + ".shadow.regions"),
                          Table.from_msgpack(SWITCH_COLUMNS, raw["switch"],
                                             what + ".shadow.switch"))

