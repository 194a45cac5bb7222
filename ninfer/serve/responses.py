"""JSON responses rendered with orjson (fast, and strict: no NaN, valid UTF-8 only)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse


class JSONBody(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)
