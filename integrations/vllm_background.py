"""A vLLM client call on a thread for the duration of a `with` block (the trainer engine's
sender drives the workers while it runs its own part of the plan)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    """Run `fn(*args)` on a thread for the duration of a `with` block; its error is kept in
    `error` (and re-raised at the end of the block unless `reraise=False`)."""

    def __init__(self, timeout_s: float, fn: Callable[..., None], *args: Any,
                 reraise: bool = True) -> None:
        self.timeout_s, self.reraise = timeout_s, reraise
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)

    def _run(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self.error = e

    def __enter__(self) -> Background:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"rdma_plan: the vLLM client call did not return within "
                               f"{self.timeout_s:g} s; check that the engine is running")
        if self.error is not None and self.reraise and exc[0] is None:
            raise self.error
