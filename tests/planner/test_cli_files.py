"""Issue 35: every path the CLI and the executor open is a regular file, or one clear line.

A FIFO never returns a byte until someone writes one: a reader that opens it blocks
forever. Each case runs in a child with a timeout, so a hang fails the test instead of
blocking the suite; the child times the refusal itself (imports excluded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.clock import no_answer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = """
import json, sys, time
kind, fifo, cfg = sys.argv[1:4]
from planner.cli import main
import planner.compiler, planner.tools.inspect, schemas.plan, schemas.config_load  # uncounted
t0 = time.process_time()  # CPU seconds: a FIFO is refused without reading (bounded work)
if kind == "plan":
    code = main(["inspect", fifo])
elif kind == "plan-executor":
    from schemas.errors import UserError
    from schemas.plan import load_rank
    try:
        load_rank(fifo, 0)
        code = 0
    except UserError as e:
        print("rdma-plan: error:", e, file=sys.stderr)
        code = 2
elif kind == "key":
    code = main(["compile", cfg, "-o", cfg + ".rplan", "--sign-key", fifo])
else:  # config, model-config
    code = main(["compile", cfg, "-o", cfg + ".rplan"])
print(json.dumps({"code": code, "s": time.process_time() - t0}))
"""

CONFIG = """model:
  config: {model}
source: {{framework: fsdp2, dp: 2}}
target: {{engine: vllm, tp: 2}}
"""


def _config(tmp_path, model: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.format(model=json.dumps(model)))  # YAML reads JSON's escapes
    return str(path)


@pytest.mark.parametrize("kind", ["plan", "plan-executor", "key", "config", "model-config"])
def test_a_fifo_is_refused_at_once(tmp_path, kind) -> None:
    fifo = str(tmp_path / "f")
    os.mkfifo(fifo)
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 256,
                                 "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "head_dim": 128, "intermediate_size": 256, "vocab_size": 64,
                                 "num_hidden_layers": 1}))
    cfg = fifo if kind == "config" else _config(tmp_path, fifo if kind == "model-config"
                                                else str(model))
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, kind, fifo, cfg], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(no_answer(f"reading a FIFO as a {kind} (a hang)", 60))
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["code"] == 2, out.stderr
    assert res["s"] < 1.0, res  # CPU seconds of the child
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "rdma-plan: error:" in lines[0], out.stderr
    assert "regular file" in lines[0] or "not a regular" in lines[0], lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("where", ["plan", "config", "model-config", "key", "output"])
def test_a_nul_byte_in_a_path_is_exit_2_and_a_message(tmp_path, where, capsys) -> None:
    from planner.cli import main

    model = tmp_path / "config.json"
    model.write_text("{}")
    bad = str(tmp_path / "a\0b")
    cfg = _config(tmp_path, bad if where == "model-config" else str(model))
    argv = {"plan": ["inspect", bad],
            "config": ["compile", bad, "-o", str(tmp_path / "p.rplan")],
            "model-config": ["compile", cfg, "-o", str(tmp_path / "p.rplan")],
            "key": ["compile", cfg, "-o", str(tmp_path / "p.rplan"), "--sign-key", bad],
            "output": ["compile", cfg, "-o", bad]}[where]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rdma-plan: error:"), err
    assert "NUL" in err[0], err[0]


def test_a_nul_byte_in_the_plan_key_path_is_refused_by_the_executor_api(tmp_path) -> None:
    from schemas.errors import PlanFormatError
    from schemas.integrity import plan_key

    with pytest.raises(PlanFormatError, match="NUL"):
        plan_key(str(tmp_path / "k\0ey"))


# ------------------------------------------------------- reader errors name the problem

def _header_edit(base: str, path: str, edit) -> str:
    """The plan at `base` with its header map edited by `edit` (checksum recomputed,
    unsigned): a tampered plan whose framing is valid."""
    import io
    import struct

    import msgpack

    from schemas import plan as P

    data = open(base, "rb").read()
    raw, start = P.read_raw_header(io.BytesIO(data))
    raw.pop("signature", None)
    edit(raw)
    head = msgpack.packb(raw, use_bin_type=True)
    with open(path, "wb") as f:
        f.write(P.MAGIC + struct.pack("<IQ", P.FORMAT_VERSION, len(head)) + head
                + P.checksum(head) + data[start:])
    return path


@pytest.mark.parametrize("command,edit,says", [
    ("inspect", lambda h: h.__setitem__("ranks", []), None),
    ("simulate", lambda h: h["cluster"].__setitem__("nic_gbps", 1e308), "nic_gbps"),
    ("simulate", lambda h: h.__setitem__("nvlink_gbps", 1e308), "nvlink_gbps"),
    ("tensors", lambda h: None, None),
], ids=["inspect-no-rank-rows", "simulate-huge-nic", "simulate-huge-nvlink", "tensors-inf"])
def test_reader_errors_name_the_problem(tmp_path, capsys, command, edit, says) -> None:
    """What the red team found behind the CLI's old catch-all (an IndexError in inspect's
    staging note, a ValueError deep in the simulator, an OverflowError decoding tensor
    shapes): each file is read (exit 0) or refused naming the field (exit 2), and a
    reader's bug would now be a traceback, not a line blaming the file."""
    from planner.cli import main
    from tests.property import fuzz

    base = fuzz.base_plans(str(tmp_path))["fp8"]
    path = _header_edit(base, str(tmp_path / "m.rplan"), edit)
    if command == "tensors":  # an inf in a rank's tensor shapes (the tensors blob)
        path = _tensors_inf(path, str(tmp_path / "t.rplan"))
    argv = {"inspect": ["inspect", path], "simulate": ["simulate", path],
            "tensors": ["tensors", path, "--rank", "0"]}[command]
    code = main(argv)
    err = capsys.readouterr().err
    if says is None:
        assert code in (0, 2) and "cannot be read as a plan" not in err, err
        if code == 2:
            assert "tensors/0" in err and "malformed" in err, err
    else:
        assert code == 2 and says in err and "cannot be read as a plan" not in err, err


def _tensors_inf(base: str, path: str) -> str:
    import io
    import struct

    import msgpack

    from schemas import plan as P
    from schemas.plan_codec import inflate

    data = open(base, "rb").read()
    raw, start = P.read_raw_header(io.BytesIO(data))
    off, n, _ = raw["blobs"]["tensors/0"]
    blob = msgpack.unpackb(inflate(data[start + off:start + off + n], "tensors/0"), raw=False)
    blob["shapes"][0][0] = float("inf")
    new = msgpack.packb(blob, use_bin_type=True)
    body = bytearray(data[start:])
    end = len(body)
    body += new
    raw["blobs"]["tensors/0"] = [end, len(new), P.checksum(new)]
    head = msgpack.packb(raw, use_bin_type=True)
    with open(path, "wb") as f:
        f.write(P.MAGIC + struct.pack("<IQ", P.FORMAT_VERSION, len(head)) + head
                + P.checksum(head) + bytes(body))
    return path
