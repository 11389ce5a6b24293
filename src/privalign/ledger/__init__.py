"""A durable privacy ledger: the privacy filter's rule inside database transactions.

Every budget guards one reward model / private data set. Charging has two steps:

1. ``reserve``: before generation, in one transaction, admit the query's worst case
   (epsilon_max, delta) under the filter rule (``accounting.filter.admits``), or refuse.
2. ``settle``: after selection, in one transaction, charge the realised cost
   (``accounting.filter.charge_amount``: ex-post under FSRC, the worst case under basic
   composition; ``charge_rho``: the query's rho under zCDP) and release the rest of the
   reservation.

Each reservation records the query's privacy event (mechanism, parameters as JSON, epsilon_max,
delta, rho) and each settlement the realised epsilon, so a budget can be re-accounted under another
composition (``account``, ``privalign ledger account``). A zcdp budget admits by rho against its
rho_total (the largest rho whose conversion fits its (epsilon_total, delta_total)).

The record is append-only: one ``events`` row per reservation, settlement or recovery, never
updated or deleted. Per-budget counters are updated in the same transactions, so admission does
not scan the history; ``check`` recomputes them from the events. ``recover`` (run at start-up)
settles every reservation whose request died at its worst case: it is never refunded, since the
candidates may have been observed.

The rule lives in ``ledger.budgets`` (``Ledger``), the records in ``ledger.store`` (``Store``:
connections, schema, transactions, group commit), the values in ``ledger.state``. Back ends share
schema and logic: SQLite (a path; WAL mode, ``synchronous=FULL``, ``BEGIN
IMMEDIATE``, safe across threads and processes on one machine) and PostgreSQL (a
``postgresql://`` URL; ``SELECT ... FOR UPDATE`` row locks, for several replicas on several
machines).
"""

from .budgets import Ledger
from .state import BudgetExhausted, BudgetState, UnknownBudget
from .store import MIGRATIONS, SCHEMA, Store

__all__ = ["MIGRATIONS", "SCHEMA", "BudgetExhausted", "BudgetState", "Ledger", "Store", "UnknownBudget"]
