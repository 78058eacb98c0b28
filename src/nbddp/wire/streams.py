"""A rank's output stream as the notebook (or a host's relay) reads it: bytes from a
socket, decoded into text pieces and the end markers a worker writes after each cell.

On a Unix socket the bytes come as the rank wrote them; on TCP they come in
authenticated frames (:mod:`nbddp.wire.frames`), which this reads one by one.
"""

from __future__ import annotations

import codecs
import os

from . import protocol as P
from .frames import Channel, FrameError

__all__ = ["CHUNK", "Stream"]

CHUNK = 1 << 16  # what one read of a stream takes at most


class Stream:
    """One rank's stdout or stderr: raw bytes in, text pieces and end markers out.

    ``conn`` is None for a rank behind a relay: the relay feeds its bytes (such a
    rank writes no end markers; its Done comes after all it wrote).
    """

    def __init__(self, conn: Channel | None, name: str) -> None:
        self.conn = conn
        self.fd = None if conn is None else conn.fileno()
        self.framed = conn is not None and conn.mode != "plain"
        self.failed = ""  # a frame failed its check: the stream was closed for this
        self.name = name
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""
        self.eof = False

    def read_bytes(self, ready: bool = False) -> bytes | None:
        """What one read gives (at most CHUNK bytes; b"": the end); None: nothing yet.
        ``ready``: a select said the stream is readable."""
        if self.framed:
            return self._read_frames(ready)
        try:
            return os.read(self.fd, CHUNK)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _read_frames(self, ready: bool) -> bytes | None:
        """A frame (``ready``: the selector will say when there is more), or every frame
        already here; a frame that fails its check ends the stream."""
        if self.conn.closed:
            return b""
        if not ready and not self.conn.poll(0):
            return None
        parts = []
        try:
            while len(parts) < 16:
                parts.append(self.conn.recv_bytes(ready=True))
                if not self.conn.pending() and (ready or not self.conn.poll(0)):
                    break
        except (FrameError, TimeoutError) as exc:  # the end of it, and the rank's (hub)
            self.failed = str(exc) or "a frame stalled"
            self.conn.close()
            if not parts:
                return b""
        except (EOFError, OSError):
            self.conn.close()
            if not parts:
                return b""
        return b"".join(parts)

    def read(self, ready: bool = False) -> list[str | int]:
        data = self.read_bytes(ready)
        return [] if data is None else self.feed(data)

    def feed(self, data: bytes) -> list[str | int]:
        """Text pieces and end markers in ``data``; no data is the end of the stream."""
        if not data:
            self.eof = True
            text = self._held + self._decoder.decode(b"", final=True)
            self._held = ""
            return [text] if text else []
        pieces, self._held = P.split_markers(self._held + self._decoder.decode(data))
        return pieces

    def read_available(self) -> list[str | int]:
        """Everything already written, without waiting (used when the writer died)."""
        if self.fd is None:  # a relay sent all there was before the rank's end
            return [] if self.eof else self.feed(b"")
        if not self.framed:  # (a channel's socket is not blocking already)
            os.set_blocking(self.fd, False)
        pieces: list[str | int] = []
        while not self.eof:
            got = self.read()
            if not got and not self.eof:
                break
            pieces += got
        return pieces
