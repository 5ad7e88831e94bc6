"""What every admin route module shares: the role dependencies, the documented error
responses, the audit helper and the decoding of Redis hashes into JSON values."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import AfterValidator

from gateway.admin.auth import AdminPrincipal, require_role
from gateway.auth import is_principal
from gateway.state import Gateway
from shared import keys, metrics
from shared.audit import audit
from shared.text import as_str

MAX_LIST = 1000  # the most items one listing route returns

viewer = Depends(require_role("viewer"))
operator = Depends(require_role("operator"))
admin = Depends(require_role("admin"))

def _mcp_principal(name: str) -> str:
    if not is_principal(name):
        raise ValueError("not a principal's name: 1-128 of A-Z a-z 0-9 _ . @ : -, not starting with admin:")
    return name


# A name an MCP principal can have (gateway/auth.py); ``admin:<key name>`` is how the audit log
# names admin keys, so a record made for a principal can never pass for one of theirs.
McpPrincipal = Annotated[str, AfterValidator(_mcp_principal)]

E400 = {"description": "input the route cannot accept (malformed body, bad identifier)"}
E401 = {"description": "no valid admin key"}
E403 = {"description": "the key's role may not do this"}
E404 = {"description": "not found"}
E409 = {"description": "conflict"}
E422 = {"description": "invalid input"}


def admin_router() -> APIRouter:
    """A router for routes under /admin, documented with the answers every one of them may give."""
    return APIRouter(prefix="/admin", tags=["admin"], responses={401: E401, 403: E403})


async def audit_action(gateway: Gateway, who: AdminPrincipal, action: str, **fields: Any) -> None:
    """Every admin action goes to the audit stream, as ``admin:<key name>`` with its role."""
    metrics.ADMIN_ACTIONS.labels(action).inc()
    await audit(gateway.redis, principal=who.audit_name, action=action, role=who.role, **fields)


def _number(raw: Any) -> Any:
    """A Redis string back to a number where it is one (NaN becomes None)."""
    s = as_str(raw)
    try:
        return int(s)
    except ValueError:
        pass
    try:
        f = float(s)
        return f if f == f else None
    except ValueError:
        return s


def redis_hash(raw: dict[Any, Any] | None) -> dict[str, Any]:
    """A Redis hash as JSON: names decoded, values as numbers where they are numbers."""
    return {as_str(k): _number(v) for k, v in (raw or {}).items()}


async def current_version(gateway: Gateway) -> int | None:
    """The model version the trainer published last, if any."""
    v = await gateway.redis.get(keys.MODEL_VERSION)
    return int(v) if v is not None and as_str(v).lstrip("-").isdigit() else None
