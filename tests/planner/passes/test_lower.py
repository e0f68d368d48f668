"""Regressions of the lower pass (`planner/passes/lower.py`), geometry spelled out; found
by the property suite (tests/property/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from planner.compiler import compile_file, compile_layouts
from planner.passes.coalesce import coalesce
from planner.passes.lower import Lowered, _fit, _narrow_dtypes, direct_stage
from planner.passes.lower_cols import Writes, _smaller
from planner.spec import spec_from_hf
from planner.tools.verify import verify_plan
from schemas.plan import PACK, QUANT, STAGING, UNPACK, load_plan
from schemas.protocol import staging_index, write_stages
from tests.support.synthetic import (
    SMALL_HF,
    TINY,
    fused_col_split,
    small_config,
    whole_tensors,
)
from tests.support.synthetic import tiny_config as config

ROOT = Path(__file__).resolve().parents[3]


def test_staging_budget_not_a_multiple_of_64() -> None:
    # 1 fp32 source rank -> 1 bf16 target rank, whole tensors: every tensor is cast, so
    # every chunk is packed into the source's staging. staging_bytes=150: stage 0 takes
    # embed_tokens (128 bytes at 0; the next offset is aligned to 128) and then
    # input_layernorm (16 bytes, fits: 128 + 16 <= 150) at 128; the staging region is
    # then sized to the aligned end 128 + 64 = 192 > 150.
    spec = spec_from_hf(TINY)
    plan = compile_layouts(config(max_write_bytes=4096, staging_bytes=150), spec,
                           whole_tensors(spec, "source", "float32"),
                           whole_tensors(spec, "target", "bfloat16"))
    staging = [r.nbytes for rp in plan.ranks for r in rp.regions if r.name == STAGING]
    assert max(staging) <= 150
    assert verify_plan(plan) == []




def test_blocks_do_not_change_the_plan(monkeypatch) -> None:
    # `lower` classifies chunks and makes their direct writes a block at a time: blocks of
    # 3 chunks (boundaries inside every tensor's chunks) must give the same op tables as
    # one block for all. A 4-way column split into 2 x TP 2 column shards: each target
    # half-column comes from 2 sources as strided quarters (direct row writes, or a pack
    # and an unpack: both occur at these overheads).
    from planner.passes import lower

    spec = spec_from_hf(SMALL_HF)
    layouts = (fused_col_split(spec, 4, 1), fused_col_split(spec, 2, 2))
    cfg = small_config(write_overhead_us=0.5)
    whole = compile_layouts(cfg, spec, *layouts)
    monkeypatch.setattr(lower, "BLOCK", 3)
    cut = compile_layouts(cfg, spec, *layouts)
    st = whole.header.stats
    assert st.unpacks > 0 and st.writes > st.unpacks + st.packs  # staged and direct
    for a, b in zip(whole.ranks, cut.ranks, strict=True):
        for table in ("writes", "batches", "copies", "signals", "waits"):
            assert getattr(a, table).to_msgpack() == getattr(b, table).to_msgpack(), table


def test_direct_stage_by_what_the_staged_chunks_need() -> None:
    # kinds of the staged chunks' copies -> the stage of the direct writes (3 staged stages)
    table = [((), 0), ((PACK,), 0), ((PACK, UNPACK), 0), ((UNPACK,), 3), ((QUANT,), 0)]
    for kinds, at in table:
        assert direct_stage(np.array(kinds, dtype=np.uint8), 3) == at, kinds


def test_direct_writes_go_after_chunks_that_are_only_unpacked(tmp_path: Path) -> None:
    # plans/demo.yaml: Megatron TP 2 -> 2 x vLLM TP 1 on one host. o_proj and down_proj
    # are split by columns at the source: each lands on a target as strided half rows,
    # written into its staging and unpacked (no source packs). Every other chunk is a
    # direct write, in stage 1, after them: the targets' unpacks of stage 0 run while the
    # direct writes land.
    path = str(tmp_path / "demo.rplan")
    compile_file(str(ROOT / "plans" / "demo.yaml"), path)
    plan = load_plan(path)
    assert verify_plan(plan) == []
    staging = {rp.rank: staging_index(rp) for rp in plan.ranks}
    for rp in plan.ranks[:2]:  # the sources
        w, stage = rp.writes, write_stages(rp)
        into = np.array([staging[d] == r for d, r in zip(w["dst_rank"].tolist(),
                                                         w["dst_region"].tolist())])
        assert into.any() and (~into).any()
        assert set(stage[into].tolist()) == {0} and set(stage[~into].tolist()) == {1}
        assert not (rp.copies["kind"] == PACK).any()
    for rp in plan.ranks[2:]:
        assert set(rp.copies["stage"][rp.copies["kind"] == UNPACK].tolist()) == {0}


def _writes(n: int, dt: type, src_offset: int = 0, nbytes: int = 1) -> Writes:
    return Writes(**{k: np.full(n, v, dtype=np.int32 if k not in (
        "src_offset", "dst_offset", "nbytes") else dt) for k, v in dict(
        src_rank=1, src_region=2, src_offset=src_offset, dst_rank=3, dst_region=4,
        dst_offset=5, nbytes=nbytes, stage=0).items()})


def test_lowered_offsets_widen_to_int64_only_where_a_write_ends_past_int32() -> None:
    """`lower` holds offsets and bytes as int32 while every write fits; a part that starts
    below 0 or ends (offset + bytes) past int32's largest value widens the columns to int64
    with the rows already put kept, so no offset wraps around."""
    top = np.iinfo(np.int32).max
    out = _writes(4, np.int32, src_offset=7, nbytes=9)
    assert _fit(out, _writes(2, np.int64, src_offset=top - 10, nbytes=10)) is out  # ends at top
    for part in (_writes(2, np.int64, src_offset=top - 10, nbytes=11),  # one byte past
                 _writes(2, np.int64, src_offset=-1)):
        wide = _fit(out, part)
        assert wide is not out
        for k in ("src_offset", "dst_offset", "nbytes"):
            assert getattr(wide, k).dtype == np.int64
            assert np.array_equal(getattr(wide, k), getattr(out, k))
        assert wide.src_rank is out.src_rank  # ranks, regions and stages stay int32
        end = wide.put(1, part)
        assert end == 3 and int(wide.src_offset[1]) == int(part.src_offset[0])
    already = _writes(2, np.int64)
    assert _fit(already, _writes(1, np.int64, src_offset=top)) is already



def test_alike_copies_made_once_give_the_plan_made_per_copy(tmp_path: Path, monkeypatch
                                                            ) -> None:
    # 4 alike replicas that stage the same chunks from the same sources: their staged
    # chunks made for the first copy (`_alike`) give the plan every copy made on its own
    # gives, byte for byte
    from planner.passes import lower

    config = str(ROOT / "plans" / "published" / "qwen3-30b-a3b_ep4tp2dp2_to_vllm-tp4dp4.yaml")
    seen: list[int] = []
    alike = lower._alike
    monkeypatch.setattr(lower, "_alike", lambda c, si: seen.append(alike(c, si)) or seen[-1])
    compile_file(config, str(tmp_path / "once.plan"))
    assert seen == [4]
    monkeypatch.setattr(lower, "_alike", lambda c, si: 1)
    compile_file(config, str(tmp_path / "each.plan"))
    assert (tmp_path / "once.plan").read_bytes() == (tmp_path / "each.plan").read_bytes()


def test_direct_writes_repeated_give_the_plan_made_per_copy(tmp_path: Path, monkeypatch
                                                            ) -> None:
    # 4 alike replicas whose blocks take the same sources: a next copy's block of direct
    # writes copied from the first copy's, target ranks moved (`Writes.repeat`), gives the
    # plan each block made afresh gives, byte for byte
    from planner.passes import lower

    config = str(ROOT / "plans" / "qwen3-8b_megatron-tp4pp2_vllm-tp2x4.yaml")
    rows: list[int] = []
    repeat = Writes.repeat
    monkeypatch.setattr(Writes, "repeat", lambda self, src, at, n, name, by: rows.append(n)
                        or repeat(self, src, at, n, name, by))
    compile_file(config, str(tmp_path / "once.plan"))
    assert sum(rows) > 1000
    direct_into = lower._direct_into
    monkeypatch.setattr(lower, "_direct_into", lambda out, at, c, block, rows, kept, same:
                        direct_into(out, at, c, block, rows, None, same))  # nothing kept
    compile_file(config, str(tmp_path / "each.plan"))
    assert (tmp_path / "once.plan").read_bytes() == (tmp_path / "each.plan").read_bytes()


def test_lowered_ranks_regions_stages_as_narrow_as_the_plan_allows() -> None:
    # `lower`'s rank, region and stage columns: the narrowest int that holds the world's
    # ranks, every region id (a rank's staging is its last) and every stage; the merged
    # columns `coalesce` gives are int32 again, as the plan's tables are
    dt = _narrow_dtypes(300, np.array([5, 127, 40]), 128)
    assert dt["w_src_rank"] == dt["w_dst_rank"] == np.int16
    assert dt["w_src_region"] == dt["w_dst_region"] == np.int8
    assert dt["w_stage"] == np.int8
    dt = _narrow_dtypes(128, np.array([128]), 129)
    assert (dt["w_src_rank"], dt["w_src_region"], dt["w_stage"]) == (np.int8, np.int16,
                                                                     np.int16)
    assert _narrow_dtypes(1 << 15, np.array([1 << 15]), 2)["w_dst_region"] == np.int32
    n = 4
    low = Lowered(w_src_rank=np.array([1, 1, 0, 1], np.int16),
                  w_src_region=np.array([2, 2, 2, 2], np.int8),
                  w_src_offset=np.array([0, 8, 0, 16], np.int32),
                  w_dst_rank=np.array([3, 3, 3, 3], np.int16),
                  w_dst_region=np.array([0, 0, 1, 0], np.int8),
                  w_dst_offset=np.array([0, 8, 0, 16], np.int32),
                  w_nbytes=np.full(n, 8, np.int32), w_stage=np.zeros(n, np.int8),
                  copies={}, staging=np.zeros(4, np.int64), stages=1)
    out = coalesce([low], 1 << 20)
    for k in ("w_src_rank", "w_src_region", "w_dst_rank", "w_dst_region", "w_stage"):
        assert getattr(out, k).dtype == np.int32, k
    assert out.w_nbytes.tolist() == [8, 24] and out.w_src_rank.tolist() == [0, 1]


def test_copy_columns_as_narrow_as_their_values() -> None:
    # an int32 copy column as int8 or int16 where every value fits (emit casts it back)
    assert _smaller(np.array([-128, 127], np.int32)).dtype == np.int8
    assert _smaller(np.array([0, 128], np.int32)).dtype == np.int16
    assert _smaller(np.array([0, 1 << 15], np.int32)).dtype == np.int32
    assert _smaller(np.array([0, 1], np.int64)).dtype == np.int64  # (int64: `_narrow`'s)
    assert _smaller(np.array([7, -3], np.int32)).tolist() == [7, -3]
