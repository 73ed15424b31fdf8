"""A mixin for objects that hold a resource until `close()`: `with obj:` closes on exit."""

from typing import Self


class Closing:
    """Context-manager protocol for a class that defines `close()`."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
