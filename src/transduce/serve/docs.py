"""The API's documentation page: /docs (Swagger UI), rendered from /openapi.json.
FastAPI's page loads its script and styles from a CDN, so on a machine with no network
it stays blank; here the files come from the fastapi-offline package's copy, served
under /docs-assets/, and Swagger UI's badge from its online validator is off. (ReDoc is
not offered: its bundle fetches its vendor's logo from a CDN.)"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from transduce.serve.limits import ApiError

ASSETS = "/docs-assets"
MEDIA_TYPES = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8",
               "swagger-ui.css": "text/css; charset=utf-8",
               "favicon.png": "image/png"}


@functools.cache
def _asset(name: str) -> bytes:
    """A file of the page, read on first use (1.7 MB in all)."""
    return (resources.files("fastapi_offline") / "static" / name).read_bytes()


def routes(title: str, openapi_url: str) -> APIRouter:
    """GET /docs and its files; the app is made with docs_url=redoc_url=None."""
    router = APIRouter()

    @router.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{title} - Swagger UI",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None})

    @router.get(ASSETS + "/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in MEDIA_TYPES:
            raise ApiError(404, f"no file {ASSETS.lstrip('/')}/{name}")
        return Response(_asset(name), media_type=MEDIA_TYPES[name],
                        headers={"Cache-Control": "public, max-age=86400"})

    return router
