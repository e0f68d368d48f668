"""The planner's own error types, in one place (their base classes: `schemas/errors.py`).

A `UserError` is bad input: the command line prints it as one line (exit 2). The rest is
for the planner's own control flow.
"""

from __future__ import annotations

from schemas.errors import ConfigError, UserError


class TraceError(ConfigError):
    """vLLM's loader does something a traced layout cannot express."""


class NotIncremental(UserError):
    """This plan cannot be edited for the new placement; compile it in full."""


class LeanMiss(RuntimeError):
    """The trace used something the lean import of vLLM left out (the tracer then imports
    vLLM whole)."""
