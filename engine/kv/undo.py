"""An undo log for tentative KV changes (BROS packs candidates, then keeps or rolls back).

Outside a transaction nothing is logged (FCFS pays nothing). `mark()` starts logging and
returns a position; `rollback(mark)` undoes every change made since, newest first;
`settle()` ends the transaction and forgets the log.
"""

from __future__ import annotations

from collections.abc import Callable


class UndoLog:
    def __init__(self) -> None:
        self._log: list[Callable[[], None]] | None = None
        # A plain attribute, not a property: the ledger's primitives read it on every change to
        # skip building an undo closure when nothing is logged.
        self.active = False

    def mark(self) -> int:
        if self._log is None:
            self._log = []
            self.active = True
        return len(self._log)

    def push(self, undo: Callable[[], None]) -> None:
        if self._log is not None:
            self._log.append(undo)

    def rollback(self, mark: int) -> None:
        log = self._log
        if log is None:
            return
        while len(log) > mark:
            log.pop()()

    def settle(self) -> None:
        self._log = None
        self.active = False
