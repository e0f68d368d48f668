"""The one base class of every error that bad input causes (config, plan file, tensors, store).

A user error is caught by the CLI and printed as one line (exit 2); anything else is a bug
in rdma-plan and prints as one, with its traceback. Subclass `UserError`, never catch bare
`ValueError` to mean "bad input".
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: the message names the key or tensor, the value and the fix, in one line."""


class ConfigError(UserError):
    """A config value a user got wrong. The message names the key, the value and the fix."""
