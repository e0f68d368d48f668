"""`rdma-plan tensors PLAN --rank N [--json]` and `rdma-plan inspect PLAN --ranks`.

`tensors` prints what rank N binds (`schemas.tensors.rank_tensors`: name, shape, dtype,
parameter or buffer, and the boxes of logical tensors each holds); `--ranks` prints every
rank's identity (`schemas/identity.py`) as a table, one column per coordinate.
"""

from __future__ import annotations

import json

from schemas.identity import KEYS, check_identities
from schemas.plan import open_plan, read_header
from schemas.tensors import Piece, rank_tensors


def _box(p: Piece) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(p.offsets, p.sizes)) + "]"


def tensors_text(path: str, rank: int, as_json: bool = False) -> str:
    """What rank `rank` binds, as a table (or JSON)."""
    rt = rank_tensors(path, rank)
    if as_json:
        return json.dumps(rt.json(), indent=1)
    ident = " ".join(f"{k}={v}" for k, v in (rt.identity or {}).items()) or "none recorded"
    head = (f"rank {rt.rank} ({rt.role}): {len(rt.tensors)} tensors; identity: {ident}",
            "")
    rows = [("name", "shape", "dtype", "kind", "holds (logical tensor [box])")]
    for t in rt.tensors:
        held = "; ".join(f"{p.tensor} {_box(p)}" for p in t.pieces) or "(padding only)"
        rows.append((t.name, "x".join(map(str, t.shape)) or "scalar", t.dtype,
                     "buffer" if t.buffer else "param", held))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    return "\n".join([*head, *lines])


def ranks_text(path: str) -> str:
    """Every rank's role, host, GPU and identity coordinates, one line each."""
    with open_plan(path) as f:
        header, _ = read_header(f, path)
    world, sources = header.world, header.sources
    if not header.identities:
        return f"{path}: no rank identities recorded (compiled by an older rdma-plan)"
    idents = check_identities(list(header.identities), world, sources, path)
    ranks = header.ranks
    keys = [k for fw in KEYS for k in KEYS[fw]
            if any(i["framework"] == fw for i in idents)]
    keys = list(dict.fromkeys(keys))
    rows = [["rank", "role", "host", "gpu", "framework", *keys]]
    for r, ident in enumerate(idents):
        host, gpu = (ranks[r].host, ranks[r].gpu) if r < len(ranks) else ("?", "?")
        rows.append([str(r), "source" if r < sources else "target", str(host),
                     str(gpu), str(ident["framework"]),
                     *[str(ident.get(k, "-")) for k in keys]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i != 1 and i != 4 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                     for row in rows)
