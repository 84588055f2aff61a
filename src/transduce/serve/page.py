"""The page at /: the model's box (translate, generate, encode) and an attention
explorer, as files of the package (static/: HTML, CSS, JavaScript; no CDN, so it works
on a machine with no network)."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from transduce.serve.limits import ApiError

STATIC = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}


def routes(kind: str) -> APIRouter:
    """GET / and /static/{name}; the page adapts itself to the model's kind."""
    router = APIRouter()
    files = resources.files("transduce.serve") / "static"
    page = (files / "index.html").read_text(encoding="utf-8").replace("{{kind}}", kind)
    assets = {name: (files / name).read_bytes() for name in STATIC}

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @router.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in assets:
            raise ApiError(404, f"no file static/{name}")
        return Response(assets[name], media_type=STATIC[name],
                        headers={"Cache-Control": "no-cache"})

    return router
