"""The admin API about itself: its OpenAPI document, the dashboard's static files, the
caller's identity, and the answer for what no admin route matched (``fallback``, included
after every other admin router)."""

from __future__ import annotations

import copy
import re
import weakref
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse

from gateway.admin.auth import AdminPrincipal
from gateway.admin.common import E400, E401, E403, E404, admin_router, viewer

UI_DIR = Path(__file__).with_name("ui")
UI_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
# The dashboard runs its own script and style sheet only, and no other site may frame it: the page
# holds an admin key (in local storage), and a script injected into it, or a page that overlays it,
# would act with that key.
UI_HEADERS = {"Cache-Control": "no-store",
              "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                                         "base-uri 'none'; frame-ancestors 'none'",
              "X-Frame-Options": "DENY"}
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "HEAD")

API_DESCRIPTION = (
    "Operate a learnmesh mesh. Bearer admin keys; roles viewer < operator < admin. Every operation "
    "may answer 400 for input it cannot accept, 401 without a valid admin key and 403 when the key's "
    "role may not act; operations on a named resource answer 404 when it does not exist.")

router = admin_router()
fallback = APIRouter(prefix="/admin")

# Per app: its routes are fixed once it serves, so the document is built once.
_docs: weakref.WeakKeyDictionary[FastAPI, dict[str, Any]] = weakref.WeakKeyDictionary()


def admin_doc(app: FastAPI) -> dict[str, Any]:
    """OpenAPI of every route under /admin, with the security scheme and the common answers."""
    cached = _docs.get(app)
    if cached is not None:
        return cached
    full = copy.deepcopy(app.openapi())
    doc: dict[str, Any] = {
        "openapi": full.get("openapi", "3.1.0"),
        "info": {"title": "learnmesh admin API", "version": "1", "description": API_DESCRIPTION},
        "paths": {p: ops for p, ops in full.get("paths", {}).items() if p.startswith("/admin/")},
        "components": full.get("components", {}),
    }
    doc["components"].setdefault("securitySchemes", {})["adminKey"] = {"type": "http", "scheme": "bearer"}
    doc["security"] = [{"adminKey": []}]
    for path, ops in doc["paths"].items():
        for op in ops.values():
            if isinstance(op, dict) and "responses" in op:
                op["responses"].setdefault("400", {"description": E400["description"]})
                op["responses"].setdefault("401", {"description": E401["description"]})
                op["responses"].setdefault("403", {"description": E403["description"]})
                if "{" in path:
                    op["responses"].setdefault("404", {"description": E404["description"]})
    _docs[app] = doc
    return doc


@router.get("/openapi.json", include_in_schema=False)
async def admin_openapi(request: Request) -> JSONResponse:
    return JSONResponse(admin_doc(request.app))


@fallback.get("", include_in_schema=False)
@fallback.get("/", include_in_schema=False)
async def admin_root() -> RedirectResponse:
    """``/admin`` as a person types it: the dashboard (which asks for a key itself)."""
    return RedirectResponse("/admin/ui", status_code=307)


@router.get("/ui", include_in_schema=False)
@router.get("/ui/", include_in_schema=False)  # the address as browsers and people often write it
async def ui_index() -> HTMLResponse:
    return HTMLResponse((UI_DIR / "index.html").read_text(), headers=UI_HEADERS)


@router.get("/ui/{name}", include_in_schema=False)
async def ui_file(name: str) -> FileResponse:
    if name not in UI_FILES:
        raise HTTPException(404, "no such file")
    return FileResponse(UI_DIR / name, media_type=UI_FILES[name], headers=UI_HEADERS)


@router.get("/whoami", summary="The calling admin key's name and role")
async def whoami(who: AdminPrincipal = viewer) -> dict[str, Any]:
    return {"name": who.name, "role": who.role, "source": who.source}


def _template_match(template: str, path: str) -> bool:
    pattern = "^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)) + "$"
    return re.match(pattern, path) is not None


@fallback.api_route("/{rest:path}", methods=list(METHODS), include_in_schema=False)
async def unsupported(request: Request, rest: str) -> JSONResponse:
    """405 with the documented methods in ``Allow`` when the path exists (one path can span
    several routers), else 404."""
    allowed: set[str] = set()
    for template, ops in admin_doc(request.app)["paths"].items():
        if _template_match(template, request.url.path):
            allowed |= {m.upper() for m in ops}
    if not allowed:
        return JSONResponse({"detail": "Not Found"}, status_code=404)
    if "GET" in allowed:  # served as the GET without its body (gateway/transports/edge.py)
        allowed.add("HEAD")
    return JSONResponse({"detail": "Method Not Allowed"}, status_code=405,
                        headers={"Allow": ", ".join(sorted(allowed))})
