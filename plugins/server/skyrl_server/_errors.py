"""The one error a request handler raises for bad input: a 4xx with a one-line message."""

from __future__ import annotations


class BadRequest(Exception):
    """The request cannot be served as sent; ``status`` is the HTTP status (4xx)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = " ".join(str(message).split())  # one line
        self.status = status
