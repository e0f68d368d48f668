"""What `executor.load` checks about who this process is, before anything is registered.

- identity (`schemas/identity.py`): the caller's identity must equal the plan's identity of
  the rank it loads, and the rank's part must have been compiled for that identity (the
  part carries it under its digest): two ranks with equal tensor shapes cannot be swapped,
  neither by the launcher (ranks in another order) nor in the file (parts swapped). A load
  without an identity is refused unless the caller opts out with `no_identity=True`
  (logged): integrations derive the identity from the framework; a caller that does not
  use one takes the responsibility for the rank order.
- signing on the trainer and engine paths (`signing`): with a job secret set, a plan
  loaded without `plan_key` is refused unless `allow_unsigned=True` (logged).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from schemas.errors import IdentityError
from schemas.header import PlanHeader
from schemas.identity import check_against_plan, check_part, plan_identity

from .auth import ENV

log = logging.getLogger("executor")


def check_identity(header: PlanHeader, part_identity: Any, rank: int,
                   identity: dict | None, no_identity: bool, path: str = "plan") -> None:
    """Refuse (`IdentityError`, naming both) a load whose identity is missing (unless
    `no_identity`) or differs from the plan's for `rank`, or a part moved from another rank."""
    if identity is None:
        if not no_identity:
            want = plan_identity(header, rank, path)
            hint = f" (the plan's rank {rank} is {_describe(want)})" if want else ""
            raise IdentityError(
                f"rank {rank}: executor.load without identity={hint}: nothing tells this "
                "process is that rank; pass identity= (integrations.megatron/fsdp2.bind give "
                "b.identity) or no_identity=True to trust the rank number (logged)")
        log.warning("rank %d of %s loaded without an identity (no_identity=True): the rank "
                    "order is the caller's responsibility", rank, path)
    else:
        check_against_plan(header, rank, identity, path)
    check_part(header, part_identity, rank, path)


def signing(plan_key: Any, allow_unsigned: bool, secret: Any = None, where: str = "rdma_plan"
            ) -> None:
    """The trainer and engine paths: with a job secret (`secret`, else `RDMA_PLAN_SECRET`)
    a plan must be loaded with `plan_key` (its signature checked) unless `allow_unsigned`."""
    if plan_key is not None:
        return
    if secret is None and not os.environ.get(ENV):
        return
    if not allow_unsigned:
        raise IdentityError(f"{where}: a job secret is set but no plan_key: the plan's "
                            "signature would not be checked; pass plan_key= (the key of "
                            "`rdma-plan compile --sign-key FILE`) or allow_unsigned=True "
                            "(logged)")
    log.warning("%s: plan loaded without a plan_key although a job secret is set "
                "(allow_unsigned=True)", where)


def _describe(ident: dict) -> str:
    from schemas.identity import describe

    return describe(ident)
