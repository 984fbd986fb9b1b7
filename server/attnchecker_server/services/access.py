"""Which runs a token may write: agents only their own (created by that token) and the one they are bound to.

Operators may write to every run. A run created before ownership existed (owner NULL) is claimed by the next
agent token that registers it, so upgrading a collector does not lock running jobs out for good.
"""

from ..auth import Principal
from ..errors import Forbidden
from ..models import Run

__all__ = ["check_may_register", "check_may_write", "may_write"]


def may_write(principal: Principal, run: Run) -> bool:
    if principal.role == "operator":
        return True
    if principal.run_name is not None:
        return principal.run_name == run.name
    return run.owner_token_id is not None and run.owner_token_id == principal.token_id


def check_may_write(principal: Principal, run: Run) -> None:
    if not may_write(principal, run):
        raise Forbidden(
            f"this token may not write to run {run.name!r}: an agent token writes only to the runs it created or the "
            "run it is bound to (`attnchecker-server token create --role agent --run NAME` for the ranks of one job)"
        )


def check_may_register(principal: Principal, name: str) -> None:
    """A bound token registers only its run's name (it exists for that one job)."""
    if principal.role != "operator" and principal.run_name is not None and principal.run_name != name:
        raise Forbidden(
            f"this token is bound to run {principal.run_name!r} and may not register {name!r}; "
            "use a token bound to that run, or an unbound agent token"
        )
