"""A plan read one rank at a time: what `verify`, `inspect` and `simulate` hold of a large
plan (a large model's plan is over a GB; one rank's part is a few MB).

`PlanFile(path)` checks what `load_plan` checks of the file as a whole (header, checksum,
one blob per rank) at open; `rank(r)` decodes and checksums one rank's blob. `PlanRanks`
gives a `Plan` already in memory the same face, so each tool has one implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, BinaryIO

from schemas.header import PlanFormatError, PlanHeader
from schemas.plan import (
    COVERAGE_COLUMNS,
    DAG_EDGE_COLUMNS,
    DAG_NODE_COLUMNS,
    Plan,
    RankPlan,
    Table,
    decode_explain,
    open_plan,
    read_blob,
    read_header,
)


class PlanRanks:
    """A plan in memory, rank by rank."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.header: PlanHeader = plan.header
        self.world = len(plan.ranks)

    def rank(self, r: int) -> RankPlan:
        return self.plan.ranks[r]

    def dag(self) -> tuple[Table, Table, Table]:
        """The stage DAG's nodes and edges, and the coverage table."""
        return self.plan.dag_nodes, self.plan.dag_edges, self.plan.coverage

    def check_rest(self, progress: Callable[[str], None] | None = None) -> None:
        """Check the blobs other than the ranks and the DAG (in memory: nothing to check)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> PlanRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PlanFile(PlanRanks):
    """A plan file, rank by rank (`key`: the plan must be signed with it)."""

    def __init__(self, path: str, key: bytes | None = None) -> None:
        self.path = path
        self.f: BinaryIO = open_plan(path)  # a regular file only
        try:
            self.header, self.start = read_header(self.f, path, key)
            world = self.header.world
            names = [n for n in self.header.blobs if n.startswith("rank/")]
            if len(names) != world or set(names) != {f"rank/{r}" for r in range(world)}:
                raise PlanFormatError(f"{path}: the header says world={world} but the file "
                                      f"holds {len(names)} rank blobs; the file is corrupt")
        except BaseException:
            self.f.close()
            raise
        self.world = world

    def blob(self, name: str) -> Any:
        return read_blob(self.f, self.header, self.start, name, self.path)

    def rank(self, r: int) -> RankPlan:
        rp = RankPlan.decode(self.blob(f"rank/{r}"))
        if rp.rank != r:
            raise PlanFormatError(f"{self.path}: blob rank/{r} holds the plan of rank "
                                  f"{rp.rank}; the file is corrupt")
        return rp

    def dag(self) -> tuple[Table, Table, Table]:
        dag = self.blob("dag")
        if not isinstance(dag, dict):
            raise PlanFormatError(f"{self.path}: dag blob is malformed")
        try:
            return (Table.from_msgpack(DAG_NODE_COLUMNS, dag["nodes"], "dag.nodes"),
                    Table.from_msgpack(DAG_EDGE_COLUMNS, dag["edges"], "dag.edges"),
                    Table.from_msgpack(COVERAGE_COLUMNS, dag["coverage"], "coverage"))
        except (KeyError, TypeError) as e:
            raise PlanFormatError(f"{self.path}: dag blob is malformed ({e})") from None

    def check_rest(self, progress: Callable[[str], None] | None = None) -> None:
        """The explain blob and any further blobs, checksummed and decoded, as `load_plan`
        does (one at a time, nothing kept). The explain blob is a third of a large plan's
        bytes (seconds at DeepSeek-V3 scale): a step of its own for `progress`."""
        if progress is not None:
            progress("checking the explain blob")
        decode_explain(self.blob("explain"), self.path)
        for name in self.header.blobs:
            if not name.startswith("rank/") and name not in ("explain", "dag"):
                self.blob(name)

    def check_all(self, progress: Callable[[str], None] | None = None) -> None:
        """What `load_plan` checks of the file, one blob at a time, nothing kept: every
        rank's part decoded, the DAG, the explain blob and the rest (`check_rest`)."""
        tick = ticker(progress, "ranks", self.world)
        for r in range(self.world):
            self.rank(r)
            tick(r)
        self.dag()
        self.check_rest(progress)

    def close(self) -> None:
        self.f.close()


def ticker(progress: Callable[[str], None] | None, what: str, total: int
           ) -> Callable[[int], None]:
    """`tick(i)` reports `what i/total` to `progress` at every tenth of `total`."""
    step = max(1, total // 10)

    def tick(i: int) -> None:
        if progress is not None and (i % step == 0 or i == total - 1):
            progress(f"{what} {i + 1}/{total}")
    return tick
