"""Loading a plan can never run code: no pickle-family loaders in the packages, and plans
with msgpack extension types, timestamps or absurd sizes fail with `PlanFormatError`."""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import msgpack
import pytest

from schemas import plan as P

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "planner", "executor")
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve",
                  "joblib", "copyreg", "pickletools"}
BANNED_CALLS = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("builtins", "eval"),
                ("builtins", "exec")}


def _violations(source: str, name: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [node.module or ""]
        else:
            mods = []
        out += [f"{name}:{node.lineno}: imports {m}" for m in mods
                if m.split(".")[0] in BANNED_MODULES]
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("eval", "exec", "__import__"):
                out.append(f"{name}:{node.lineno}: calls {f.id}")
            if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                    and (f.value.id, f.attr) in BANNED_CALLS):
                out.append(f"{name}:{node.lineno}: calls {f.value.id}.{f.attr} (pickle-based)")
    return out


def test_scanner_finds_what_it_looks_for():
    bad = "import pickle\nfrom dill import loads\nimport torch\ntorch.load('x')\neval('1')\n"
    assert len(_violations(bad, "bad.py")) == 4


def test_no_pickle_family_loading_in_the_packages():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 20
    found = [v for p in files for v in _violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "\n".join(found)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    from tests.support.plans import save, two_by_two

    path = tmp_path_factory.mktemp("sec") / "good.rplan"
    save(str(path), two_by_two())
    return path


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    from planner.compiler import compile_file

    path = tmp_path_factory.mktemp("sec") / "demo.rplan"
    compile_file(str(ROOT / "plans" / "demo.yaml"), str(path))
    return path


def _with_header(good: Path, out: Path, edit) -> Path:
    raw = good.read_bytes()
    with open(good, "rb") as f:
        header, start = P.read_raw_header(f)
    edit(header)
    hb = msgpack.packb(header, use_bin_type=True)
    out.write_bytes(P.MAGIC + struct.pack("<IQ", P.FORMAT_VERSION, len(hb)) + hb
                    + P.checksum(hb) + raw[start:])
    return out


def _with_blob(good: Path, out: Path, name: str, blob: bytes) -> Path:
    """Replace blob `name` by `blob`, with a correct index entry and checksum."""
    raw = good.read_bytes()
    with open(good, "rb") as f:
        header, start = P.read_raw_header(f)
    body, index, offset = b"", {}, 0
    for n, (off, length, _) in sorted(header["blobs"].items(), key=lambda kv: kv[1][0]):
        data = blob if n == name else raw[start + off:start + off + length]
        index[n] = [offset, len(data), P.checksum(data)]
        body += data
        offset += len(data)
    header["blobs"] = index
    hb = msgpack.packb(header, use_bin_type=True)
    out.write_bytes(P.MAGIC + struct.pack("<IQ", P.FORMAT_VERSION, len(hb)) + hb
                    + P.checksum(hb) + body)
    return out


def _loads(path: Path) -> None:
    P.load_rank(str(path), 0)
    P.load_plan(str(path))


def test_good_plan_loads(good):
    _loads(good)


@pytest.mark.parametrize("value", [msgpack.ExtType(42, b"os.system('x')"),
                                   msgpack.ExtType(0, b""), msgpack.Timestamp(1, 0)])
def test_extension_types_in_the_header_are_refused(good, tmp_path, value):
    path = _with_header(good, tmp_path / "ext.rplan",
                        lambda h: h.setdefault("options", {}).update(x=[1, {"y": value}]))
    with pytest.raises(P.PlanFormatError, match="not allowed in a plan"):
        _loads(path)


def test_extension_type_in_a_rank_blob_is_refused(good, tmp_path):
    with open(good, "rb") as f:
        header, start = P.read_header(f)
        rank0 = P.read_blob(f, header, start, "rank/0")
    rank0["nics"] = [msgpack.ExtType(7, b"\x00" * 8)]
    path = _with_blob(good, tmp_path / "ext0.rplan", "rank/0",
                      msgpack.packb(rank0, use_bin_type=True))
    with pytest.raises(P.PlanFormatError, match="extension type 7 is not allowed"):
        P.load_rank(str(path), 0)


@pytest.mark.parametrize("what", ["blob_length", "blob_offset", "header_length",
                                  "array_header", "map_header", "bin_header"])
def test_absurd_sizes_are_refused_without_allocating(good, tmp_path, what):
    path = tmp_path / f"{what}.rplan"
    if what in ("blob_length", "blob_offset"):
        def edit(h):
            off, length, dg = h["blobs"]["rank/0"]
            h["blobs"]["rank/0"] = [off, 1 << 62, dg] if what == "blob_length" else \
                [1 << 62, length, dg]
        _with_header(good, path, edit)
    elif what == "header_length":
        raw = good.read_bytes()
        path.write_bytes(raw[:8] + struct.pack("<IQ", P.FORMAT_VERSION, (1 << 31) - 1)
                         + raw[20:])
    else:  # msgpack headers that claim 2**32-1 items or bytes, checksummed
        blob = {"array_header": b"\xdd\xff\xff\xff\xff", "map_header": b"\xdf\xff\xff\xff\xff",
                "bin_header": b"\xc6\xff\xff\xff\xff"}[what] + b"\x00" * 16
        _with_blob(good, path, "rank/0", blob)
    with pytest.raises(P.PlanFormatError):
        _loads(path)


@pytest.mark.parametrize("kind", ["not_a_plan", "empty", "truncated_header", "truncated",
                                  "garbage_blob"])
def test_cli_refuses_bad_plan_files_with_exit_2(compiled, tmp_path, kind, capsys):
    # `inspect` reads the header only, so it refuses files whose header is bad; `verify`
    # reads everything, so it refuses every case
    from planner.cli import main

    path = tmp_path / f"{kind}.rplan"
    raw = compiled.read_bytes()
    assert main(["inspect", str(compiled)]) == 0
    path.write_bytes({"not_a_plan": b"model:\n  config: x\n", "empty": b"",
                      "truncated_header": raw[:100], "truncated": raw[: len(raw) // 2],
                      "garbage_blob": raw[:-40] + b"\xc1" * 40}[kind])
    cmds = ("verify",) if kind in ("truncated", "garbage_blob") else ("inspect", "verify")
    capsys.readouterr()
    for cmd in cmds:
        assert main([cmd, str(path)]) == 2, cmd
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rdma-plan: error: "), err
        assert any(w in err[0] for w in ("not an rdma-plan file", "truncated", "checksum",
                                         "corrupt")), err
