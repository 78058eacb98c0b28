"""A rank's text chunks as whole lines: what a terminal would show, line by line
(a carriage return rewrites the line so far: a progress bar's last state)."""

from __future__ import annotations

__all__ = ["PARTIAL_MAX", "Lines"]

PARTIAL_MAX = 1 << 14  # characters of an unfinished line kept (its end), at most


class Lines:
    """Text chunks in, whole lines out; a carriage return rewrites the line so far.

    The unfinished line keeps only what follows its last carriage return (a
    progress bar's last state) and at most PARTIAL_MAX characters of its end, so
    a bar updated 100,000 times in one line costs each update the same.
    """

    def __init__(self) -> None:
        self.partial = ""

    def feed(self, text: str) -> list[str]:
        *lines, rest = (self.partial + text).split("\n")
        cut = rest.rstrip("\r").rfind("\r")  # ("a\r" stays: a "\n" may follow it)
        if cut >= 0:
            rest = rest[cut + 1 :]
        if len(rest) > PARTIAL_MAX:
            rest = "…" + rest[-PARTIAL_MAX:]
        self.partial = rest
        return [self.settle(line) for line in lines]

    @staticmethod
    def settle(line: str) -> str:
        if "\r" in line:  # a progress bar: its last state is the line
            stripped = line.rstrip("\r")
            line = stripped.rsplit("\r", 1)[-1]
        return line

    @property
    def current(self) -> str:
        """The unfinished line as it reads now (what a terminal would show)."""
        return self.settle(self.partial)

    def flush(self) -> list[str]:
        rest, self.partial = self.current, ""
        return [rest] if rest else []
