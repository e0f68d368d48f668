"""The `rdma-plan` command line: spec, compile, inspect, explain, verify, simulate.

Only this module reads argv and prints; each subcommand calls one library function. The
compiler, inspector and verifier are imported inside their subcommands, so `spec` and
config validation work on their own (and nothing imports torch); the model modules are
imported by `spec` and `compile` only, not by the tools that read a plan. Errors a user can cause
(`schemas.errors.UserError`: a bad config, a bad plan file; a missing file) exit 2 with
one line `rdma-plan: error: ...` per error and no traceback; any other exception is a bug
in rdma-plan and prints as one, a plan reader's included: its checks name what is wrong in
a bad plan file (`PlanFormatError`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from schemas.errors import ConfigError, ConfigErrors, UserError
from schemas.protocol import INFLIGHT

if TYPE_CHECKING:
    from planner.spec import ModelSpec

MAX_LINE = 400
"""Longest error line printed (a hostile value must not print megabytes)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors go through the same one-line error and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer (>= 1)")
    return value


# ---------------------------------------------------------------- spec

def spec_table(spec: ModelSpec) -> str:
    """The spec as a readable table: one row per logical tensor, then the totals."""
    rows = [(t.name + (" (mtp)" if t.mtp else ""), "x".join(map(str, t.shape)), t.dtype,
             f"{t.numel:,}") for t in spec.tensors]
    head = ("tensor", "shape", "dtype", "numel")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]

    def line(r: Sequence[str]) -> str:
        return "  ".join((c.rjust(w) if i == 3 else c.ljust(w))
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    d = spec.dims
    out = [line(head), line(["-" * w for w in widths]), *map(line, rows), "",
           f"model_type: {d.model_type}  layers: {d.num_layers}  hidden: {d.hidden}  "
           f"heads: {d.heads}/{d.kv_heads}  experts: {d.num_experts}  vocab: {d.vocab}",
           f"tensors: {len(spec.tensors)}",
           f"total_params: {spec.total_params / 1e9:.2f}B ({spec.total_params:,})",
           f"mtp_params: {spec.mtp_params / 1e9:.2f}B ({spec.mtp_params:,})"]
    return "\n".join(out)


def spec_json(spec: ModelSpec) -> str:
    """The spec as JSON: totals, the dims and every tensor's name, shape and dtype."""
    d = spec.dims
    return json.dumps({
        "model_type": d.model_type,
        "num_layers": d.num_layers,
        "total_params": spec.total_params,
        "mtp_params": spec.mtp_params,
        "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                     "mtp": t.mtp, "buffer": t.buffer} for t in spec.tensors],
    }, indent=1)


def _cmd_spec(args: argparse.Namespace) -> int:
    from planner.spec import load_spec  # the model modules, for this command only
    spec = load_spec(args.path, num_layers=args.num_layers)
    print(spec_json(spec) if args.json else spec_table(spec))
    return 0


# ---------------------------------------------------------------- plan commands

def _cmd_compile(args: argparse.Namespace) -> int:
    from planner.validate import load

    _check_output(args.output)
    cfg, spec = load(args.config)  # bad configs fail here, before the compiler is imported
    from planner.collector import map_large_arrays
    from planner.compiler import compile_to
    from planner.progress import Progress

    map_large_arrays()
    try:
        with Progress("compile") as progress:
            stats = compile_to(cfg, spec, args.output, progress, sign_key=args.sign_key)
    finally:
        _remove_temp(args.output)
    if "egress_bound_max_over_mean" in stats:  # max/mean is never below 1 (planner.tools.inspect)
        stats["egress_bound_max_over_mean"] = max(1.0, stats["egress_bound_max_over_mean"])
    summary = "  ".join(f"{k}={_fmt(v)}" for k, v in stats.items())
    print(f"wrote {args.output}: {summary}")
    return 0


def _check_output(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"-o: {path!r}: the folder {folder!r} does not exist; create it or "
                          "write the plan elsewhere")
    if os.path.isdir(path):
        raise ConfigError(f"-o: {path!r} is a folder; give a file name for the plan")


def _remove_temp(path: str) -> None:
    """`write_plan` writes `PATH.tmpPID` and renames it; leave nothing behind on failure."""
    try:
        os.unlink(f"{path}.tmp{os.getpid()}")
    except OSError:
        pass


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from planner.tools.inspect import inspect_text
    from schemas.chunked_plan import is_chunked

    if is_chunked(args.plan):  # a chunked shadow's chunk plans
        from planner.tools.inspect_chunked import inspect_chunked
        print(inspect_chunked(args.plan, args.json))
        return 0
    if args.ranks:
        from planner.progress import Progress
        from planner.tools.planfile import PlanFile
        from planner.tools.tensors import ranks_text

        # load_plan's checks (the executor and verify refuse what they refuse), one blob at
        # a time: memory holds one blob, not the plan
        with Progress("inspect") as progress, PlanFile(args.plan) as plan:
            plan.check_all(progress)
        print(ranks_text(args.plan))
        return 0
    from planner.progress import Progress

    traffic: list | None = [] if args.plot else None  # who writes to whom, for the picture
    with Progress("inspect") as progress:  # checks what load_plan checks, one rank at a time
        text = inspect_text(args.plan, args.json, progress, traffic)
    print(text)
    if args.plot:
        from planner.tools.plot import plot_plan, plot_traffic, traffic_path
        from schemas.plan import open_plan, read_header

        with open_plan(args.plan) as f:
            header, _ = read_header(f, args.plan)
        print(f"wrote {plot_plan(header, args.plot)}", file=sys.stderr)
        print(f"wrote {plot_traffic(header, traffic or [], traffic_path(args.plot))}",
              file=sys.stderr)
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from planner.progress import Progress
    from planner.tools.simgap import summary_text
    from planner.tools.simulate import simulate

    with Progress("simulate") as progress:
        res = simulate(args.plan, inflight=args.inflight, progress=progress,
                       model="exact" if args.exact else "coarse" if args.coarse else "auto")
    if args.plot:
        from planner.tools.plot import plot_simulation

        print(f"wrote {plot_simulation(res, args.plot)}", file=sys.stderr)
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "timeline"}, indent=1))
    else:
        print(summary_text(res))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from planner.progress import Progress
    from planner.tools.inspect import explain_text

    with Progress("explain") as progress:
        text = explain_text(args.plan, args.tensor, args.json, progress)
    print(text)
    return 0


def _cmd_tensors(args: argparse.Namespace) -> int:
    from planner.tools.tensors import tensors_text

    print(tensors_text(args.plan, args.rank, args.json))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from planner.progress import Progress
    from planner.tools.verify import verify_file
    from schemas.chunked_plan import is_chunked

    if is_chunked(args.plan):  # every chunk plan, then the file's own rules
        from planner.tools.verify_chunked import verify_chunked
        violations = verify_chunked(args.plan)
    else:
        with Progress("verify") as progress:
            violations = verify_file(args.plan, progress)
    if violations:
        print(f"rdma-plan: verify: {len(violations)} violation(s); first: {violations[0]}",
              file=sys.stderr)
        return 1
    print(f"{args.plan}: ok")
    return 0


# ---------------------------------------------------------------- parser and main

def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rdma-plan", description="Compile RL weight transfers into RDMA write "
                "plans (Megatron/FSDP2 -> vLLM/SGLang), and look inside them.")
    debug = "show the full traceback of an error instead of one line"
    p.add_argument("--debug", action="store_true", help=debug)
    common = argparse.ArgumentParser(add_help=False)  # --debug after the subcommand too
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str
            ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, parents=[common])
        sp.set_defaults(func=func)
        return sp

    sp = add("spec", _cmd_spec, "print a model's logical tensors (from its HF config.json)")
    sp.add_argument("path", help="config.json, or the folder holding it")
    sp.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sp.add_argument("--num-layers", type=int, default=None, metavar="N",
                    help="override num_hidden_layers")

    sp = add("compile", _cmd_compile, "compile a YAML config into a plan file")
    sp.add_argument("config", help="the YAML config (see docs/config.md)")
    sp.add_argument("-o", "--output", required=True, metavar="PLAN", help="plan file to write")
    sp.add_argument("--sign-key", metavar="FILE", default=None, help="sign the plan with the "
                    "key in FILE (HMAC-SHA256); ranks then load it with plan_key=FILE")

    sp = add("inspect", _cmd_inspect, "summarise a plan file")
    sp.add_argument("plan")
    sp.add_argument("--json", action="store_true", help="print JSON instead of text")
    sp.add_argument("--plot", metavar="FILE.png", help="also draw bytes per rank and per NIC, "
                    "and who writes how many bytes to whom (FILE-traffic.png; needs "
                    "matplotlib)")
    sp.add_argument("--ranks", action="store_true", help="print every rank's identity "
                    "(framework coordinates) instead")

    sp = add("tensors", _cmd_tensors, "list what one rank binds: names, shapes, dtypes, "
             "parameter or buffer, and the logical tensor boxes each holds")
    sp.add_argument("plan")
    sp.add_argument("--rank", type=int, required=True, metavar="N", help="plan rank")
    sp.add_argument("--json", action="store_true", help="print JSON instead of a table")

    sp = add("simulate", _cmd_simulate, "estimate a plan's transfer time on its cluster "
             "(flow-level simulation) against the bandwidth floor")
    sp.add_argument("plan")
    sp.add_argument("--json", action="store_true", help="print JSON (estimated_s, floor_s, "
                    "ratio, per-NIC bytes and busy time) instead of text")
    sp.add_argument("--plot", metavar="FILE.png", help="also draw per-NIC load and the "
                    "timeline of batches (needs matplotlib)")
    sp.add_argument("--inflight", type=_positive_int, default=INFLIGHT, metavar="N",
                    help="batches a rank keeps in flight (the executor's max_inflight)")
    model = sp.add_mutually_exclusive_group()
    model.add_argument("--exact", action="store_true", help="the exact model at any size "
                       "(every landing an event; minutes above ~100,000 batches); by default "
                       "plans over 20,000 batches run the coarse model, which says so")
    model.add_argument("--coarse", action="store_true", help="the coarse model at any size "
                       "(landings within a quantum land together)")

    sp = add("explain", _cmd_explain, "show how one logical tensor moves in a plan: which "
             "source ranks hold it, gathers, and every write into the targets")
    sp.add_argument("plan")
    sp.add_argument("tensor", help="the tensor's HF checkpoint name, as `rdma-plan spec` lists "
                    "it (e.g. model.layers.0.self_attn.q_proj.weight), not a native name")
    sp.add_argument("--json", action="store_true", help="print JSON instead of text")

    sp = add("verify", _cmd_verify, "check a plan's invariants (exit 1 on a violation)")
    sp.add_argument("plan")
    return p



def main(argv: Sequence[str] | None = None) -> int:
    """Run `rdma-plan`; returns the exit code (0 ok, 1 verify failed, 2 bad input)."""
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        _no_nul(args)
        if args.command == "spec" and args.num_layers is not None and args.num_layers < 1:
            raise ConfigError(f"--num-layers: {args.num_layers} must be a positive integer")
        return _run(args)
    except BrokenPipeError:  # `rdma-plan inspect PLAN | head`: the reader has all it wants
        _quiet_stdout()
        return 0
    except (UserError, OSError, _UsageError) as e:
        if args is not None and args.debug:
            raise
        errors = e.errors if isinstance(e, ConfigErrors) else (e,)
        for err in errors:
            print(f"rdma-plan: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _no_nul(args: argparse.Namespace) -> None:
    """A NUL byte cannot be in a path (the OS refuses it): say which argument has one."""
    for name, value in sorted(vars(args).items()):
        if isinstance(value, str) and "\0" in value:
            raise _UsageError(f"argument {name}: {value!r} has a NUL byte in it; give a path "
                              "(or value) without one")


def _run(args: argparse.Namespace) -> int:
    """The subcommand. A plan reader that trips over a file raises a `UserError` naming
    what is wrong in it; anything else is a bug in rdma-plan and prints as one (no
    catch-all turns it into a line about the file)."""
    return int(args.func(args))


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that Python's exit flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        text = f"{e.filename}: {e.strerror or e}"
    else:
        text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 5] + " ..."
