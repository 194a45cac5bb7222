"""The one error type every media refusal derives from, so a gateway maps them all to one 400."""

from __future__ import annotations


class MediaError(ValueError):
    """Media refused: ``kind`` is a short stable code (``too_large``, ``not_an_image``, ...), the message
    says what was wrong and, where it helps, what to change."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple[object, ...]:  # keep kind across pickling (worker pools, logs)
        return (type(self), (self.kind, str(self)))
