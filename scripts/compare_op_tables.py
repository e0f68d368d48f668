"""Do two revisions compile the example configs into the same op tables?

    python3 scripts/compare_op_tables.py REF [--only demo,qwen3-8b] [--skip-big]
                                             [--published | --no-published] [--keep DIR]

Compiles every `plans/*.yaml` and `plans/published/*.yaml` twice: at git revision REF (in
a temporary `git worktree`, with its own PYTHONPATH) and at this working tree, each with
its own `rdma-plan compile` (`python3 -m planner compile`). Then compares, rank by rank,
the op tables byte for byte: `writes`, `batches`, `copies`, `signals`, `waits`, plus the
rank's `regions`, `peer_regions` and `stages`, and the plan-wide `explain` and `dag`
blobs. The header is not compared (its format may change). Prints one row per config and
exits 1 on any difference (2 on a compile failure or bad usage).

Plans are read through `schemas.plan` (`load_rank`) of this working tree; a plan it cannot
read (an older header or format version) is read by a plain fallback that only walks the
container (magic, version, header, blob index) and decodes rank blobs as msgpack.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass

import msgpack
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_TABLES = ("writes", "batches", "copies", "signals", "waits")
RANK_FIELDS = ("regions", "peer_regions", "stages")
BIG_RANKS = 64
"""`--skip-big` skips configs whose cluster has more GPUs than this."""


@dataclass(frozen=True)
class Compiled:
    path: str
    seconds: float


# ------------------------------------------------------------------ reading a plan

def _digest(obj: object) -> str:
    return hashlib.blake2b(msgpack.packb(obj, use_bin_type=True), digest_size=16).hexdigest()


class _RawPlan:
    """The container of a plan file, any format version: header and blobs as msgpack."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 (closed by close())
        if self.f.read(8) != b"RDMAPLAN":
            raise ValueError(f"{path}: not a plan file")
        _, hlen = struct.unpack("<IQ", self.f.read(12))
        self.header = msgpack.unpackb(self.f.read(hlen), raw=False, strict_map_key=False)
        self.start = 8 + 12 + hlen + 32
        self.blobs = self.header["blobs"]

    def blob(self, name: str) -> object:
        offset, length = self.blobs[name][:2]
        self.f.seek(self.start + offset)
        data = self.f.read(length)
        if data[:2] == b"\xc1Z":  # a compact blob (format 3): a u64 size, then a zlib stream
            data = zlib.decompress(data[10:])
        return msgpack.unpackb(data, raw=False, strict_map_key=False)

    def world(self) -> int:
        return sum(1 for n in self.blobs if n.startswith("rank/"))

    def close(self) -> None:
        self.f.close()


def _rank_digests_typed(path: str, rank: int) -> dict[str, str]:
    from schemas.plan import load_rank

    _, rp = load_rank(path, rank)
    out = {t: _digest(getattr(rp, t).to_msgpack()) for t in RANK_TABLES}
    out["regions"] = _digest([[r.name, r.dtype, list(r.shape), r.nbytes] for r in rp.regions])
    out["peer_regions"] = _digest([[p, [list(rs) for rs in s]] for p, s in rp.peer_regions])
    out["stages"] = _digest(rp.stages)
    return out


def _rank_digests_raw(raw: dict) -> dict[str, str]:
    return {k: _digest(raw[k]) for k in (*RANK_TABLES, *RANK_FIELDS)}


def plan_digests(path: str) -> tuple[dict[str, dict[str, str]], str]:
    """{part: {table: digest}} for every rank (`rank/<r>`) and the plan-wide blobs, and
    which reader read it ("schemas.plan" or "fallback")."""
    raw = _RawPlan(path)
    try:
        world = raw.world()
        out: dict[str, dict[str, str]] = {}
        reader = "schemas.plan"
        for r in range(world):
            try:
                out[f"rank/{r}"] = _rank_digests_typed(path, r) if reader != "fallback" \
                    else _rank_digests_raw(raw.blob(f"rank/{r}"))
            except Exception:  # noqa: BLE001 - an older format: walk the container instead
                reader = "fallback"
                out[f"rank/{r}"] = _rank_digests_raw(raw.blob(f"rank/{r}"))
        for name in ("explain", "dag"):
            if name in raw.blobs:
                out[name] = {"blob": _digest(raw.blob(name))}
        return out, reader
    finally:
        raw.close()


def differences(a: dict[str, dict[str, str]], b: dict[str, dict[str, str]]) -> list[str]:
    """`part.table` for every table that differs or exists on one side only."""
    diff = []
    for part in sorted(set(a) | set(b), key=_part_key):
        if part not in a or part not in b:
            diff.append(f"{part} (only in {'REF' if part in a else 'tree'})")
            continue
        for table in sorted(set(a[part]) | set(b[part])):
            if a[part].get(table) != b[part].get(table):
                diff.append(f"{part}.{table}")
    return diff


def _part_key(part: str) -> tuple[int, str]:
    return (int(part.split("/")[1]), "") if part.startswith("rank/") else (1 << 30, part)


# ------------------------------------------------------------------ compiling

def configs(tree: str, published: bool) -> list[str]:
    """Config paths relative to the tree: plans/*.yaml, then plans/published/*.yaml."""
    out = sorted(f"plans/{n}" for n in os.listdir(os.path.join(tree, "plans"))
                 if n.endswith(".yaml"))
    pub = os.path.join(tree, "plans", "published")
    if published and os.path.isdir(pub):
        out += sorted(f"plans/published/{n}" for n in os.listdir(pub) if n.endswith(".yaml"))
    return out


def cluster_gpus(path: str) -> int:
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    c = cfg.get("cluster") or {}
    return int(c.get("hosts", 1)) * int(c.get("gpus_per_host", 8))


def compile_in(tree: str, config: str, out: str) -> Compiled:
    """`rdma-plan compile` of `tree` (its own PYTHONPATH and cwd) on its copy of `config`."""
    env = {**os.environ, "PYTHONPATH": tree}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "planner", "compile", config, "-o", out],
                       cwd=tree, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"compile {config} in {tree} failed (exit {p.returncode}): "
                           + " | ".join(tail))
    return Compiled(out, time.perf_counter() - t0)


def ref_worktree(ref: str, where: str) -> str:
    path = os.path.join(where, "ref")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "--quiet", path, ref],
                   check=True)
    return path


def compare_one(ref_tree: str, config: str, tmp: str) -> tuple[str, list[str], str]:
    """(status, differing tables, one-line detail) of one config."""
    if not os.path.exists(os.path.join(ref_tree, config)):
        return "new", [], "not at REF"
    a = compile_in(ref_tree, config, os.path.join(tmp, "ref.rplan"))
    b = compile_in(ROOT, config, os.path.join(tmp, "tree.rplan"))
    da, ra = plan_digests(a.path)
    db, rb = plan_digests(b.path)
    ranks = sum(1 for p in db if p.startswith("rank/"))
    detail = (f"{ranks} ranks, compile {a.seconds:.1f}s -> {b.seconds:.1f}s, "
              f"read {ra} / {rb}")
    for p in (a.path, b.path):
        os.remove(p)
    diff = differences(da, db)
    return ("DIFF" if diff else "same"), diff, detail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ref", help="git revision to compare against (e.g. main, HEAD~3)")
    p.add_argument("--only", default="", metavar="A,B",
                   help="only configs whose file name contains one of these (comma list)")
    p.add_argument("--skip-big", action="store_true",
                   help=f"skip configs on more than {BIG_RANKS} GPUs (minutes, GBs each)")
    p.add_argument("--no-published", dest="published", action="store_false",
                   help="only plans/*.yaml, not plans/published/*.yaml")
    p.add_argument("--keep", metavar="DIR", help="use DIR for temporary files and keep it")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    tmp = args.keep or tempfile.mkdtemp(prefix="compare-op-tables-")
    os.makedirs(tmp, exist_ok=True)
    try:
        ref_tree = ref_worktree(args.ref, tmp)
    except subprocess.CalledProcessError:
        print(f"compare_op_tables: cannot check out {args.ref!r}; give a git revision",
              file=sys.stderr)
        return 2
    failed = 0
    try:
        print(f"REF {args.ref} ({ref_tree}) vs working tree {ROOT}")
        print(f"{'config':<62} {'result':<6} detail")
        for config in configs(ROOT, args.published):
            name = os.path.basename(config)
            if only and not any(s in name for s in only):
                continue
            if args.skip_big and cluster_gpus(os.path.join(ROOT, config)) > BIG_RANKS:
                print(f"{config:<62} {'skip':<6} big (> {BIG_RANKS} GPUs)")
                continue
            try:
                status, diff, detail = compare_one(ref_tree, config, tmp)
            except RuntimeError as e:
                status, diff, detail = "ERROR", [], str(e)
                failed = max(failed, 2)
            if diff:
                failed = max(failed, 1)
                shown = ", ".join(diff[:6]) + (f" (+{len(diff) - 6} more)"
                                               if len(diff) > 6 else "")
                detail += f"; differs: {shown}"
            print(f"{config:<62} {status:<6} {detail}", flush=True)
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", ref_tree],
                       check=False)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("identical op tables" if not failed else "DIFFERENCES FOUND" if failed == 1
          else "COMPILE FAILURES")
    return failed


if __name__ == "__main__":
    sys.exit(main())
