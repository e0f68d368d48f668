"""Best-effort steps: work whose failure must not hide the error or the result at hand (an
ABORT to a peer that may be gone, publishing a step to a store that may be gone, forgetting
a dead peer's agent). Every such step goes through `best_effort`, which logs what it
swallowed; nothing else in the executor catches an error to ignore it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("executor")

T = TypeVar("T")


def best_effort(what: str, fn: Callable[..., T], *args: Any, default: Any = None,
                **kwargs: Any) -> T | Any:
    """`fn(*args, **kwargs)`, or `default` when it raises an `Exception`; then one log line
    (INFO) names `what` was attempted and the error it raised."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the one place that swallows, and it logs
        log.info("%s failed, ignored: %s: %s", what, type(e).__name__, e)
        return default
