"""The API's documentation pages: /docs (Swagger UI) and /redoc (ReDoc), rendered from
/openapi.json. FastAPI's own pages load their scripts and styles from a CDN, so on a
machine with no network they stay blank; here the files come from the fastapi-offline
package's copy, served under /docs-assets/."""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from transduce.serve.limits import ApiError

ASSETS = "/docs-assets"
MEDIA_TYPES = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8",
               "swagger-ui.css": "text/css; charset=utf-8",
               "redoc.standalone.js": "text/javascript; charset=utf-8",
               "favicon.png": "image/png"}


@functools.cache
def _asset(name: str) -> bytes:
    """A file of the pages, read on first use (2.8 MB in all)."""
    return (resources.files("fastapi_offline") / "static" / name).read_bytes()


def routes(title: str, openapi_url: str) -> APIRouter:
    """GET /docs, /redoc and their files; the app is made with docs_url=redoc_url=None."""
    router = APIRouter()
    favicon = f"{ASSETS}/favicon.png"

    @router.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{title} - Swagger UI",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css", swagger_favicon_url=favicon)

    @router.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=openapi_url, title=f"{title} - ReDoc",
                              redoc_js_url=f"{ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=favicon, with_google_fonts=False)

    @router.get(ASSETS + "/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in MEDIA_TYPES:
            raise ApiError(404, f"no file {ASSETS.lstrip('/')}/{name}")
        return Response(_asset(name), media_type=MEDIA_TYPES[name],
                        headers={"Cache-Control": "public, max-age=86400"})

    return router
