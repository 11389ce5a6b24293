"""Settling what a process reserved, whatever fails: the keep-alive thread (heartbeat, recovery of
dead processes' reservations at their worst case) and the worst-case settlements that failed while
the database was failing, retried until they commit."""

from __future__ import annotations

import threading
import time

from ..ledger import Ledger


class Settlement:
    """One process's side of the ledger's lease: starts the keep-alive thread at once."""

    def __init__(self, ledger: Ledger, lease_s: float):
        self.ledger, self.lease_s = ledger, lease_s
        self.recovered = ledger.recover()  # reservations of dead processes (never refunded)
        self._stopped = threading.Event()
        self.pending: set = set()  # reservations whose worst-case settlement failed: retried
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self):
        """Heartbeat, recover the reservations of processes whose lease has expired, and settle (at
        their worst case) this process's reservations whose settlement failed while the database
        was failing, as soon as it works again."""
        beat = self.lease_s / 3
        last = time.monotonic()
        while not self._stopped.wait(min(beat, 1.0)):
            self.settle_pending()
            if time.monotonic() - last < beat:
                continue
            last = time.monotonic()
            try:
                self.ledger.heartbeat()
                self.recovered += self.ledger.recover()
            except Exception:  # a transient database error must not kill the heartbeat
                pass

    def settle_pending(self) -> None:
        with self._lock:
            pending = sorted(self.pending)
        for rid in pending:
            try:
                self.ledger.settle_all(rid, None)
            except Exception as e:
                if "unique" not in str(e).lower() and "Integrity" not in type(e).__name__:
                    continue  # still failing: try again on the next tick
                # already settled (its first settlement did commit): nothing is owed
            with self._lock:
                self.pending.discard(rid)

    def worst_case(self, rid: list[int]) -> None:
        """Charge a reservation's worst case; if even that fails (the database is failing), the
        reservation stays open (held, so the budget cannot be overspent), and the keep-alive thread
        settles it as soon as the database works again (or, should this process die first, another
        process recovers it at its worst case once the lease lapses)."""
        try:
            self.ledger.settle_all(rid, None)
        except Exception:
            with self._lock:
                self.pending.add(tuple(rid))
