"""pdb in a rank, answered from the notebook.

``breakpoint()``, ``pdb.set_trace()``, ``torch.distributed.breakpoint()`` and
``%ddp debug`` (post-mortem) all make a :class:`pdb.Pdb`; in a worker, every
``Pdb`` made without its own stdin and stdout talks to the notebook instead of
the rank's (absent) terminal. Each time it wants a line, the rank sends
:class:`~nbddp.wire.protocol.DebugPrompt` with what pdb wrote since the last line and
its prompt, ``(Pdb rank 1)``; the notebook asks in the cell's input box (the
stdin channel that ``input()`` uses) and answers with
:class:`~nbddp.wire.protocol.DebugInput`. No line (the input was closed, the cell
was interrupted, the front end has no stdin) reads as end of input, on which
pdb quits: the cell ends with that rank's ``BdbQuit``, nothing hangs.

The main thread waits for the line; the receiver thread hands it over
(:meth:`Remote.answer`), so interrupts, stack samples and aborts work as in any
other cell.
"""

from __future__ import annotations

import pdb
import queue

from ..wire import protocol as P

__all__ = ["Remote", "install"]


class Remote:
    """pdb's stdin and stdout in one: what it writes is kept until it asks for a line."""

    def __init__(self, send, rank: int) -> None:
        self._send = send
        self.prompt = f"(Pdb rank {rank}) "
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        self._written: list[str] = []
        self._seq = 0

    def write(self, text: str) -> int:
        self._written.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        text = "".join(self._written)
        self._written.clear()
        prompt = self.prompt if text.endswith(self.prompt) else ""
        self._seq += 1
        self._send(P.DebugPrompt(text[: len(text) - len(prompt)], prompt, self._seq))
        while True:  # (an answer to an earlier prompt, one Ctrl-C ago, is not for this one)
            seq, line = self._lines.get()
            if seq == self._seq:
                return "" if line is None else line + "\n"

    def answer(self, answer: P.DebugInput) -> None:
        """From the receiver thread: the line the notebook sent (None: none will come)."""
        self._lines.put((answer.seq, answer.line))


def install(send, rank: int) -> Remote:
    """Make every ``pdb.Pdb`` of this process without its own streams talk to the notebook."""
    remote = Remote(send, rank)
    original = pdb.Pdb.__init__

    def __init__(self, completekey="tab", stdin=None, stdout=None, *args, **kwargs):
        ours = stdin is None and stdout is None
        if ours and not args:  # pdb's own Ctrl-C handler would turn the stop button into
            kwargs.setdefault("nosigint", True)  # a new prompt instead of an interrupt
        original(self, completekey, stdin or remote, stdout or remote, *args, **kwargs)
        if ours:
            self.prompt = remote.prompt

    pdb.Pdb.__init__ = __init__
    return remote
