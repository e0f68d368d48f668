"""Trace engines in this process with vLLM imported lean (`planner/layouts/vllm_lean.py`),
as the forked tracer does; `tests/oracles/test_vllm_trace_lean.py` runs it in a fresh
interpreter (the lean import stays in the process that made it) and compares its rows with
the same traces made with vLLM imported whole.

    python3 -m tests.support.lean_trace OUT.json < cases.json

Input: a JSON list of `[name, hf config, TargetConfig keywords]`. Output (into OUT.json;
vLLM logs to stdout): `{"lean": whether
the lean import was installed, "used": the modules it replaced, "rows": {name:
traced._trace_rows(...) or {"error": line}}}`.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def trace_rows(hf: dict[str, Any], kw: dict[str, Any], spec: Any = None) -> Any:
    """One engine's `traced._trace_rows` (the tracer's answer), or its one-line error."""
    from planner.layouts import traced
    from planner.spec import spec_from_hf
    from schemas.config import ConfigError, TargetConfig

    cfg = TargetConfig(engine="vllm", layout="traced", **({"dtype": "float32"} | kw))
    try:
        return traced._trace_rows(spec or spec_from_hf(hf, mtp=False), hf, cfg)
    except ConfigError as e:
        return {"error": str(e)}


def main() -> None:
    """Specs first (as the compiling process builds them before it forks the tracer), then
    the lean import, then the traces."""
    from planner.layouts import vllm_lean
    from planner.spec import spec_from_hf

    cases = [(name, hf, kw, spec_from_hf(hf, mtp=False)) for name, hf, kw in json.load(sys.stdin)]
    lean = vllm_lean.install()
    rows = {name: trace_rows(hf, kw, spec) for name, hf, kw, spec in cases}
    with open(sys.argv[1], "w") as f:
        json.dump({"lean": lean, "used": sorted(vllm_lean.used()), "rows": rows}, f)


if __name__ == "__main__":
    main()
