"""The one base class of every error that bad input causes (config, plan file, tensors, store).

A user error is caught by the CLI and printed as one line (exit 2); anything else is a bug
in rdma-plan and prints as one, with its traceback. Subclass `UserError`, never catch bare
`ValueError` to mean "bad input". A config's independent mistakes are collected and reported
together (`ConfigErrors`, `raise_all`, `check_each`).
"""

from __future__ import annotations

from typing import Any


class UserError(ValueError):
    """Bad input: the message names the key or tensor, the value and the fix, in one line."""


class PlanFormatError(UserError):
    """A plan file that cannot be trusted: wrong magic or version, bad checksum, truncation,
    a malformed or out-of-range value."""


class IdentityError(UserError):
    """An identity is malformed, or the caller's identity differs from the plan's."""


class ConfigError(UserError):
    """A config value a user got wrong. The message names the key, the value and the fix."""


MAX_ERRORS = 10
"""Most errors of one file reported (a file of 10,000 unknown keys prints 11 lines)."""


class ConfigErrors(ConfigError):
    """Several independent config errors of one file, reported together (one line each)."""

    def __init__(self, errors: list[ConfigError], more: int = 0) -> None:
        self.errors = tuple(errors)
        """The errors reported (at most `MAX_ERRORS`), then one line counting the rest."""
        self.more = more
        """Errors found beyond those listed."""
        if more:
            self.errors += (ConfigError(f"... and {more} more errors; fix these first"),)
        super().__init__("; ".join(str(e) for e in self.errors))


def raise_all(errors: list[ConfigError]) -> None:
    """Raise nothing, the one error, or all of them (at most `MAX_ERRORS`) as
    `ConfigErrors`."""
    flat: list[ConfigError] = []
    more = 0
    for e in errors:
        if isinstance(e, ConfigErrors):
            flat += e.errors[:len(e.errors) - (1 if e.more else 0)]
            more += e.more
        else:
            flat.append(e)
    more += max(0, len(flat) - MAX_ERRORS)
    flat = flat[:MAX_ERRORS]
    if len(flat) == 1 and not more:
        raise flat[0]
    if flat:
        raise ConfigErrors(flat, more)


class OwnValueError(ConfigError):
    """A key's own value is wrong, whatever the other keys say (a size below 1, a bandwidth
    out of range): reported even beside another key's type error."""


def check_each(*checks: Any) -> None:
    """Run every check (a callable raising `ConfigError`) and report all that fail: one
    section's independent mistakes each get their line."""
    errors: list[ConfigError] = []
    for check in checks:
        try:
            check()
        except ConfigError as e:
            errors.append(e)
    raise_all(errors)
