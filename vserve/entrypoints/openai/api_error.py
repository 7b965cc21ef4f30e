"""`APIError`: an error with an HTTP status, apart from `errors.py` (which renders it and
imports the web stack) so that the command line's checks of the server's flags
(`limits.py`, `tool_settings.py`) import no web framework before the engine starts."""

from __future__ import annotations


class APIError(Exception):
    """An error with an HTTP status, turned into an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
