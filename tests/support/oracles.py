"""Is each oracle installed? One answer for every test module, and one command for setup.

The oracle tests compare the compiler with real vLLM, Megatron-Core, SGLang and
transformers on CPU. `scripts/setup.sh --test` installs them, pinned
(`tests/oracles/requirements-*.txt`). When one is missing:
- for a user who installed without `--test`, the test module is skipped with a reason that
  names the install command;
- under CI (`CI=true`), the module fails: a missing install step must fail CI, as it would
  fail a user who followed the README.

`require(name)` is cheap (no import of the oracle: vLLM's takes ~20 s, SGLang's ~30 s): the
package is findable, every pinned distribution is installed, and the frameworks themselves
(`EXACT`) at their pinned versions.
`python3 -m tests.support.oracles` (the last step of `setup.sh --test`) imports each oracle
for real, each in its own process, and exits 1 naming the first error of each that fails.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
REQS = ROOT / "tests" / "oracles"
INSTALL = "bash scripts/setup.sh --test"


@dataclass(frozen=True)
class Oracle:
    """One real framework the tests compare with."""

    module: str                # the package the tests need
    probe: str                 # the statement `main` runs in a fresh interpreter
    requirements: str = ""     # tests/oracles/requirements-*.txt pinning what it imports
    site: str = ""             # a private --target folder (SGLang), else the interpreter's
    pinned: str = ""           # a pin of its own, when no requirements file lists it


def _sglang_site() -> str:
    from tests.oracles import sglang_env

    return sglang_env.SITE


ORACLES: dict[str, Oracle] = {
    "transformers": Oracle("transformers", "import transformers.models.qwen3"),
    "vllm": Oracle("vllm", "import vllm.model_executor.model_loader, vllm.distributed",
                   "requirements-vllm.txt"),
    "megatron": Oracle("megatron.core", "import megatron.core.parallel_state",
                       pinned="megatron-core==0.16.1"),
    "sglang": Oracle("sglang", "from tests.oracles import sglang_env as e; e.prepare(); "
                     "import sglang.srt.models.qwen3", "requirements-sglang.txt", "sglang"),
}


def pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a requirements file, names normalised as pip does."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


def _installed(site: str) -> dict[str, str]:
    dists = md.distributions(path=[site]) if site else md.distributions()
    return {d.metadata["Name"].lower().replace("_", "-"): d.version for d in dists
            if d.metadata["Name"]}


EXACT = {"vllm", "transformers", "megatron-core", "sglang", "triton", "torch"}
"""Pins that must match exactly: the frameworks the oracles compare with. Every other pinned
distribution must be present; a newer helper package (`packaging`, `idna`) that another
install step brought is not a missing install step."""


@cache
def missing(name: str) -> tuple[str, ...]:
    """What of oracle `name` is not installed as pinned (empty when all is there)."""
    o = ORACLES[name]
    site = _sglang_site() if o.site == "sglang" else ""
    if site:
        found = os.path.isfile(os.path.join(site, *o.module.split("."), "__init__.py"))
    else:
        found = importlib.util.find_spec(o.module.split(".")[0]) is not None
    out = [] if found else [f"{o.module} (not importable{' from ' + site if site else ''})"]
    want = pins(REQS / o.requirements) if o.requirements else {}
    if o.pinned:
        dist, version = o.pinned.split("==")
        want[dist] = version
    if want and found:
        have = _installed(site)
        if site:  # the private folder sees the interpreter's packages too
            have = _installed("") | have
        for dist, version in want.items():
            got = have.get(dist)
            if got is None or (dist in EXACT and got != version):
                out.append(f"{dist}=={version} (found {got or 'none'})")
    return tuple(out)


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(name: str) -> None:
    """Skip the calling test module when oracle `name` is missing (fail it under CI)."""
    gone = missing(name)
    if not gone:
        return
    what = f"oracle {name} is not installed as pinned: {', '.join(gone[:4])}"
    if under_ci():
        pytest.fail(f"{what}; CI installs it with `{INSTALL}`: an install step is missing",
                    pytrace=False)
    pytest.skip(f"{what}; install it with `{INSTALL}`", allow_module_level=True)


def probe(name: str) -> str:
    """Import oracle `name` in a fresh interpreter: '' when it works, else the error."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", ORACLES[name].probe], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode == 0:
        return ""
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {r.returncode}"


def main() -> int:
    """Check every oracle: pins, then a real import each; exit 1 if any fails."""
    bad = 0
    for name in ORACLES:
        gone = missing(name)
        err = f"missing {', '.join(gone[:4])}" if gone else probe(name)
        print(f"oracle {name}: {'ok' if not err else 'FAILED: ' + err}", flush=True)
        bad += bool(err)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
