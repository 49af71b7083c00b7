"""The two web pages: the chat at ``/`` and the pool view at ``/pool``, with their scripts and
styles under ``/web/`` (docs/web.md).

Static files shipped inside the package (``server/web/``), read once at startup and served from
memory: no build step, nothing fetched from anywhere else, so the pages work offline. They are
served without the API key, like ``/health``: a page holds no data of its own, and asks for the key
before it calls the API. Whether the server wants one is written into each page (a ``<meta>`` the
scripts read), so a page never provokes a 401 to find out. ``--no-web`` serves none of this.

Every answer carries a Content-Security-Policy that allows this origin's scripts, styles and
connections only: the pages render a model's output, and whatever slipped through their escaping
could still run no script and load nothing from elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from kvpark.server.errors import APIError

WEB_DIR = Path(__file__).with_name("web")
PAGES = {"/": "chat.html", "/pool": "pool.html"}
ASSET_PREFIX = "/web/"
OPEN_PATHS = frozenset(PAGES)  # with ASSET_PREFIX: served without the API key
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
AUTH_META = '<meta name="kvpark-auth" content="none">'
HEADERS = {
    "Cache-Control": "no-cache",  # a new version of the server serves its own pages at once
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def is_open(path: str) -> bool:
    """Whether the API key middleware lets ``path`` through without a key (the pages only)."""
    return path in OPEN_PATHS or path.startswith(ASSET_PREFIX)


class WebPages:
    """The files, read once; ``auth``: whether the server wants an API key."""

    def __init__(self, auth: bool, folder: Path = WEB_DIR) -> None:
        self.files: dict[str, tuple[bytes, str]] = {}
        for path in sorted(folder.iterdir()):
            kind = TYPES.get(path.suffix)
            if kind is None or not path.is_file():
                continue
            body = path.read_bytes()
            if path.suffix == ".html":
                marked = AUTH_META.replace("none", "key" if auth else "none")
                assert AUTH_META.encode() in body, f"{path.name} has no auth <meta>"
                body = body.replace(AUTH_META.encode(), marked.encode())
            self.files[path.name] = (body, kind)
        missing = [name for name in PAGES.values() if name not in self.files]
        if missing:
            raise RuntimeError(f"the web pages are missing from the package: {missing}")

    async def page(self, request: Request) -> Response:
        return self._file(PAGES[request.url.path])

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self.files or name in PAGES.values():
            raise APIError(404, f"no such file: {ASSET_PREFIX}{name}", "not_found_error")
        return self._file(name)

    def _file(self, name: str) -> Response:
        body, kind = self.files[name]
        return Response(body, media_type=kind, headers=HEADERS)
