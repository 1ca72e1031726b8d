"""The chat page at `/`: static files packaged with the gateway (no build step, no CDN)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"


def register_chat_page(app: FastAPI) -> None:
    index = STATIC_DIR / "index.html"

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(index, headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
