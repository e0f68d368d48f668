"""What the lean import of vLLM (`vllm_lean.py`) gives in place of what it leaves out: the
names of a placeholder module that work (`FAKES`: torch's symbolic-shape questions answered
for plain values, `torch._dynamo.disable`, sympy's `Basic`), `compile_hints_off` (the
`torch.compile` decorators hand back their function), and `LeanMiss`, raised when a trace
needs more than that (the tracer then imports vLLM whole)."""

from __future__ import annotations

import functools
import operator
from typing import Any

from planner.errors import LeanMiss


def _same(fn: Any) -> Any:
    return fn


def _compile_off(model: Any = None, **kwargs: Any) -> Any:
    return _same if model is None else model


def _disable_off(fn: Any = None, recursive: bool = True, *, reason: Any = None,
                 wrapping: bool = True) -> Any:
    """`torch._dynamo.disable` / `torch.compiler.disable` where nothing is compiled: with no
    Dynamo frame hook set (none is: Dynamo is not even imported), the real wrapper only
    calls `fn`."""
    return _same if fn is None else fn


def _plain(*values: Any) -> None:
    """Refuses a symbolic value (or anything but a plain int, bool or float): the real
    `symbolic_shapes` function would treat it (the whole import does)."""
    for v in values:
        if type(v) not in (int, bool, float):
            raise LeanMiss(f"a {type(v).__name__} asked of torch.fx.experimental."
                           "symbolic_shapes, left out by the lean import of vLLM")


def _a_bool(a: Any, skip: int = 0) -> bool:
    """`expect_true` (`skip` names the frame of a symbolic value's guard), `guard_or_false`,
    `guard_or_true`, `statically_known_true`, `guard_size_oblivious` of a plain bool: the
    bool itself, as the real ones answer."""
    if type(a) is not bool:
        _plain(a)
        raise LeanMiss(f"a {type(a).__name__} where symbolic_shapes expects a bool")
    return a


def _hint(a: Any) -> Any:
    """`guarding_hint_or_throw` of a plain int or bool: itself."""
    if type(a) not in (int, bool):
        raise LeanMiss(f"a {type(a).__name__} asked of symbolic_shapes' guarding hint")
    return a


def _has_hint(a: Any) -> bool:
    _plain(a)  # no symbolic value: the real one says True
    return True


def _is_nested_int(s: Any) -> bool:
    _plain(s)  # only a SymInt can be a nested int
    return False


def _sym_and(x: Any, *others: Any) -> Any:
    _plain(x, *others)
    for y in others:
        x = operator.and_(x, y)
    return x


def _sym_or(x: Any, *others: Any) -> Any:
    _plain(x, *others)
    for y in others:
        x = operator.or_(x, y)
    return x


def _sym_eq(x: Any, y: Any) -> Any:
    if isinstance(x, (tuple, list)) and isinstance(y, (list, tuple)):
        if len(x) != len(y):
            return False
        return functools.reduce(operator.and_, map(_sym_eq, x, y), True)
    if type(x) not in (int, bool) or type(y) not in (int, bool):
        _plain(x, y)
        raise LeanMiss("sym_eq between other than ints, left out by the lean import")
    return x == y


class _NoSympyBasic:
    """`sympy.Basic` in a process that never imports sympy: nothing is an instance of it,
    as nothing can be of the real one."""


def _nothing() -> None:
    return None


FAKES: dict[str, dict[str, Any]] = {
    "torch._dynamo": {"disable": _disable_off},
    "integrations.vllm": {"register": _nothing},
    "sympy": {"Basic": _NoSympyBasic},
    "torch.fx.experimental.symbolic_shapes": {
        "expect_true": _a_bool, "guard_or_false": _a_bool, "guard_or_true": _a_bool,
        "statically_known_true": _a_bool, "guard_size_oblivious": _a_bool,
        "guarding_hint_or_throw": _hint, "has_guarding_hint": _has_hint,
        "is_nested_int": _is_nested_int, "sym_and": _sym_and, "sym_or": _sym_or,
        "sym_eq": _sym_eq},
}
"""Names a placeholder module gives that work rather than refuse: torch's own meta
kernels (`torch._compile._disable_dynamo`, on their first call) wrap themselves in
`torch._dynamo.disable`, and ask `symbolic_shapes` (torch 2.13's functions, written for the
plain values they get here, the same answers; any symbolic value is refused)."""


def compile_hints_off() -> None:
    """`torch.compile` and the `torch.compiler` decorators vLLM applies at import give back
    the function (each would import Dynamo or Inductor; a trace compiles nothing)."""
    import torch
    import torch.compiler

    torch.compile = _compile_off  # type: ignore[assignment]
    torch.compiler.disable = _disable_off  # type: ignore[assignment]
    torch.compiler.allow_in_graph = _same  # type: ignore[assignment]
    torch.compiler.assume_constant_result = _same  # type: ignore[assignment]
