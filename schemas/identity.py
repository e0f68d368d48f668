"""Rank identity: a rank's coordinates in its framework's own terms, stored in the plan.

An identity is a flat `dict[str, int | str]`: key `framework` (a name of
`schemas.config.SOURCES` or `TARGETS`, which `KEYS` covers exactly) and that framework's
integer coordinates, all of them and no others:

- `megatron`: `tp, pp, dp, ep, etp, edp` are this rank's indices in Megatron-Core's
  tensor, pipeline, data, expert, expert-tensor and expert-data parallel groups
  (`parallel_state.get_*_rank()`); `vpp` is the number of virtual pipeline chunks the rank
  holds (`virtual_pipeline_model_parallel_size`, 1 without VPP), not an index.
- `fsdp2`: `dp_replicate, dp_shard, tp`: the rank's coordinates in the DeviceMesh
  `("dp_replicate", "dp_shard", "tp")` (size 1 dims included).
- `vllm`: `replica` (which engine), `dp, tp, pp` (the worker's ranks in its engine's DP,
  TP and PP groups), `ep` (its rank in the MoE expert-parallel group; 0 without EP).
- `sglang`: as vllm, plus `attn_tp` (the rank in the attention TP group: `tp` without DP
  attention, `tp % (tp / dp)` with it; `dp` is then the attention DP rank `tp // attn_tp`).

The plan header carries `identities`: one identity per plan rank (sources, then targets),
written by the compiler from the layout modules. `executor.load(..., identity=...)` and the
integrations compare the caller's identity with the plan's before anything is registered,
so two ranks whose tensors have equal shapes cannot be swapped silently.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .header import PlanHeader

from .config import SOURCES, TARGETS
from .errors import IdentityError

KEYS: dict[str, tuple[str, ...]] = {
    "megatron": ("tp", "pp", "vpp", "dp", "ep", "etp", "edp"),
    "fsdp2": ("dp_replicate", "dp_shard", "tp"),
    "vllm": ("replica", "dp", "tp", "pp", "ep"),
    "sglang": ("replica", "dp", "tp", "pp", "ep", "attn_tp"),
}
"""The coordinates of each framework, in display order."""
if list(KEYS) != [*SOURCES, *TARGETS]:
    raise ImportError(f"schemas.identity.KEYS names {', '.join(KEYS)}; schemas.config's "
                      f"frameworks and engines are {', '.join((*SOURCES, *TARGETS))}: give each "
                      "one its coordinates here")
HEADER_KEY = "identities"
"""The plan header key: a list with one identity per plan rank."""
_MAX = 1 << 24  # no parallel group has this many members: a larger value is corrupt


def describe(identity: dict[str, Any]) -> str:
    """`megatron tp=1 pp=0 vpp=2 ...` (keys in `KEYS` order)."""
    fw = identity.get("framework", "?")
    keys = KEYS.get(str(fw), tuple(k for k in identity if k != "framework"))
    return " ".join([str(fw)] + [f"{k}={identity.get(k, '?')}" for k in keys])


def check_identity(identity: Any, what: str = "identity") -> dict[str, int | str]:
    """A validated copy of `identity`, or `IdentityError` naming the key, value and fix."""
    if not isinstance(identity, dict):
        raise IdentityError(f"{what}: {type(identity).__name__} is not an identity; pass a dict "
                            "like {'framework': 'megatron', 'tp': 0, ...} (schemas/identity.py)")
    fw = identity.get("framework")
    if fw not in KEYS:
        raise IdentityError(f"{what}.framework: {fw!r} is not one of {', '.join(KEYS)}")
    want = KEYS[fw]
    extra = sorted(str(k) for k in identity if k != "framework" and k not in want)
    missing = [k for k in want if k not in identity]
    if extra or missing:
        raise IdentityError(f"{what}: a {fw} identity has exactly the keys {', '.join(want)}; "
                            f"missing {missing or 'none'}, unknown {extra or 'none'}")
    out: dict[str, int | str] = {"framework": fw}
    for k in want:
        v = identity[k]
        low = 1 if k == "vpp" else 0
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v < _MAX:
            raise IdentityError(f"{what}.{k}: {v!r} must be an integer >= {low} (a {fw} "
                                "coordinate)")
        out[k] = v
    return out


def check_identities(raw: Any, world: int, sources: int, what: str = "plan") -> list[dict]:
    """The header's `identities`: one valid identity per rank, sources then targets, no two
    equal. Raises `IdentityError` naming the rank."""
    if not isinstance(raw, list) or len(raw) != world:
        n = len(raw) if isinstance(raw, list) else type(raw).__name__
        raise IdentityError(f"{what}: header key {HEADER_KEY!r} must list {world} identities "
                            f"(one per rank), got {n}; the plan is corrupt: recompile it")
    out, seen = [], {}
    for r, ident in enumerate(raw):
        ident = check_identity(ident, f"{what} {HEADER_KEY}[{r}]")
        side = SOURCES if r < sources else TARGETS
        if ident["framework"] not in side:
            raise IdentityError(f"{what} {HEADER_KEY}[{r}]: framework {ident['framework']!r} on "
                                f"a {'source' if r < sources else 'target'} rank; recompile")
        key = tuple(sorted(ident.items()))
        if key in seen:
            raise IdentityError(f"{what} {HEADER_KEY}: ranks {seen[key]} and {r} have the same "
                                f"identity ({describe(ident)}); the plan is corrupt: recompile")
        seen[key] = r
        out.append(ident)
    return out


def plan_identity(header: PlanHeader, rank: int, path: str = "plan") -> dict | None:
    """Rank `rank`'s identity from a plan header, checked; None if the plan has none."""
    raw = list(header.identities)
    if not raw:
        return None
    world, sources = header.world, header.sources
    if not isinstance(world, int) or not isinstance(sources, int) or not 0 <= rank < world:
        raise IdentityError(f"{path}: rank {rank} is not in the plan (world={world!r})")
    if not isinstance(raw, list) or len(raw) != world:
        check_identities(raw, world, sources, path)  # raises with the reason
    side = SOURCES if rank < sources else TARGETS
    ident = check_identity(raw[rank], f"{path} {HEADER_KEY}[{rank}]")
    if ident["framework"] not in side:
        raise IdentityError(f"{path} {HEADER_KEY}[{rank}]: framework {ident['framework']!r} "
                            "on the wrong side; the plan is corrupt: recompile it")
    return ident


def compare(plan_ident: dict[str, Any] | None, given: Any, rank: int,
            path: str = "plan") -> None:
    """Refuse (`IdentityError`, naming both) unless the caller's identity `given` equals
    `plan_ident`, the plan's identity of `rank`."""
    mine = check_identity(given, f"rank {rank}: identity")
    if plan_ident is None:
        raise IdentityError(f"rank {rank}: identity given ({describe(mine)}) but {path} records "
                            "no rank identities; recompile it with this rdma-plan, or load "
                            "without identity=")
    if mine != plan_ident:
        raise IdentityError(f"rank {rank}: this process is {describe(mine)} but {path} rank "
                            f"{rank} is {describe(plan_ident)}; pass the plan rank whose "
                            "identity matches this process (integrations derive it)")


def check_against_plan(header: PlanHeader, rank: int, given: Any | None,
                       path: str = "plan") -> None:
    """What `executor.load(..., identity=)` calls before registering: no-op when `given` is
    None; otherwise `given` must equal rank `rank`'s identity in the plan. The error also
    names the plan rank that does have `given`'s coordinates, if any."""
    if given is None:
        return
    mine = check_identity(given, f"rank {rank}: identity")
    try:
        compare(plan_identity(header, rank, path), mine, rank, path)
    except IdentityError as e:
        other = find_rank(header, mine, path, strict=False)
        if other is None or other == rank:
            raise
        raise IdentityError(f"{e} (that identity is plan rank {other})") from None


def find_rank(header: PlanHeader, identity: Any, path: str = "plan",
              strict: bool = True) -> int | None:
    """The plan rank whose identity equals `identity`. With `strict`, `IdentityError` when
    no rank has it (naming the plan's parallel config); else None."""
    mine = check_identity(identity)
    raw = list(header.identities)
    if not raw:
        if not strict:
            return None
        raise IdentityError(f"{path} records no rank identities; recompile it with this "
                            "rdma-plan")
    for r, ident in enumerate(raw):
        if ident == mine:
            return r
    if not strict:
        return None
    side = "source" if mine["framework"] in SOURCES else "target"
    conf = getattr(header, side, None)
    conf = dataclasses.asdict(conf) if conf is not None else {}
    raise IdentityError(f"{path}: no {side} rank has the identity {describe(mine)}; the plan "
                        f"was compiled for {side} {conf}: recompile it for this job's "
                        "parallel layout")


def check_part(header: PlanHeader, part_identity: Any, rank: int, path: str = "plan") -> None:
    """Refuse a part (`rank/<r>` blob) whose own recorded identity differs from the header's
    identity of `rank`: the part of another rank moved into this slot (its digest valid).
    The part's identity is covered by its digest, which peers compare at connect, so a rank
    whose identity passed `check_against_plan` runs the part compiled for that identity."""
    if part_identity is None:  # a plan written before parts carried their identity
        return
    mine = check_identity(part_identity, f"{path} rank/{rank} identity")
    want = plan_identity(header, rank, path)
    if mine == want:
        return
    other = find_rank(header, mine, path, strict=False)
    was = f" (the part of plan rank {other})" if other is not None else ""
    raise IdentityError(f"{path}: the part of plan rank {rank} was compiled for "
                        f"{describe(mine)}{was} but the header gives rank {rank} "
                        f"{describe(want) if want else 'no identity'}; parts of the file were "
                        "swapped or edited: recompile the plan (and sign it: --sign-key)")
