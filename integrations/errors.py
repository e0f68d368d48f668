"""The integrations' errors: each names the tensor, rank, key or version and says what to do.

`TornUpdateError` is an `executor.TornUpdateError`: `except executor.TornUpdateError`
catches a torn update of any engine. The others are bad input (`UserError`), but for
`CacheNotFlushedError`: the weights are whole, SGLang kept its prefix cache.
"""

from __future__ import annotations

import executor
from schemas.errors import UserError


class TornUpdateError(executor.TornUpdateError):
    """An update did not complete on the engine: the weights are not whole (paused mode:
    partly written; shadow mode: nothing switched) and no version was committed. An
    operational failure (a peer lost mid-update), not bad input: no `UserError`."""


class EngineMismatchError(UserError):
    """The engine rank is not the plan's target rank (another engine, sizes, experts), or
    holds tensors the plan cannot write."""


class ModelMismatchError(UserError):
    """The live model and the plan disagree (names, shapes, dtypes, layers per stage)."""


class PlacementMismatchError(UserError):
    """The engine's experts sit elsewhere than the plan was compiled for."""


class StalePlanError(UserError):
    """A plan switch whose version is not newer than the running plan's (stale or replayed)."""


class CacheNotFlushedError(RuntimeError):
    """The update's weights were written whole on every rank (SGLang's post-load ran), but
    SGLang refused to flush its prefix cache because requests were running or held in place
    by the pause; the version was not committed and the engine stays paused. Not a torn
    update: do not resend. `finish_unflushed(call, version)` completes it (retracts the
    held requests, flushes, commits the version, resumes); next time pause with
    `pause_mode="retract"` (or "abort"), or drain the requests before `update`."""

    def __init__(self, message: str, version: str) -> None:
        super().__init__(message)
        self.version = version
