"""Samples for operators: a bulk import on behalf of a principal (all or nothing, through the
same :class:`~gateway.tools.learning.SampleIngest` as the ``learn`` tool) and the sample log's
statistics. Validation and Redis errors reach the client through the one error map
(gateway/errors.py)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Body, HTTPException, Request

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import operator, viewer
from gateway.auth import is_principal
from gateway.state import gateway_of
from shared.context.validation import REQUEST_ID_PATTERN, is_request_id

log = logging.getLogger(__name__)

router = APIRouter()

_JSON_BODY = Body(...)


@router.post("/admin/samples", responses={403: {"description": "the principal may not teach"},
                                          429: {"description": "the sample log is full; retry after Retry-After"}})
async def import_samples(request: Request, body: Any = _JSON_BODY, who: AdminPrincipal = operator) -> dict[str, Any]:
    """Bulk import on behalf of a principal: ``{"principal": str, "samples": [...]}``; all or nothing.
    The principal must hold the teach permission (403 otherwise), as its own ``learn`` calls do;
    its learn quota does not apply, the bound on the sample log does (429). An optional
    ``request_id`` makes a retry safe, as ``learn``'s does (the same ids, in the principal's name)."""
    gateway = gateway_of(request)
    ingest = gateway.samples
    if not isinstance(body, dict) or not is_principal(body.get("principal")):
        raise HTTPException(400, "body must be {\"principal\": str, \"samples\": [...]} with a principal's name "
                                 "(1-128 of A-Z a-z 0-9 _ . @ : -, not starting with admin:)")
    request_id = body.get("request_id")
    if request_id is not None and not is_request_id(request_id):
        raise HTTPException(400, f"request_id must match {REQUEST_ID_PATTERN} (a UUID fits)")
    samples = ingest.parse({"samples": body.get("samples")})
    await gateway.limits.check_teacher(body["principal"])
    result = await ingest.submit(body["principal"], samples, admin=who.name, request_id=request_id)
    if result.get("repeated"):
        log.info("admin %s sent request %s for principal %s again: answered as before, nothing imported",
                 who.name, request_id, body["principal"])
    else:
        log.info("admin %s imported %d samples for principal %s", who.name, len(result["ids"]), body["principal"])
    return result


@router.get("/admin/samples/stats")
async def sample_stats(request: Request, who: AdminPrincipal = viewer) -> dict[str, Any]:
    """Log length, last sequence number, the trainer's committed offset and lag, trainer progress."""
    return await gateway_of(request).samples.stats()
