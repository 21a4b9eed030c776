"""zeromem's warnings, collected while a block runs (in a spawned rank or the test process)."""
from __future__ import annotations

import logging


class ZeromemWarnings(logging.Handler):
    """`with ZeromemWarnings("text") as messages:` the "zeromem" logger's warnings that
    contain `text` (all of them by default), in order."""

    def __init__(self, containing: str = ""):
        super().__init__(logging.WARNING)
        self.containing = containing
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.containing in message:
            self.messages.append(message)

    def __enter__(self) -> list[str]:
        logging.getLogger("zeromem").addHandler(self)
        return self.messages

    def __exit__(self, *exc) -> None:
        logging.getLogger("zeromem").removeHandler(self)
