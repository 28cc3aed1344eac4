"""Things started and stopped around a `with` block: servers, watchdogs, test clusters."""

from __future__ import annotations

from typing import Self


class Started:
    """`with thing:` starts it and stops it, however the block ends; subclasses define
    `start()` and `stop()`."""

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> object:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
