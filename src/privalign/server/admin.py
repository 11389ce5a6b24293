"""An admin's ``POST /v1/budgets/{name}`` body: which fields it may name, and what the rest keep.

Fields: ``epsilon_total``, ``delta_total``, ``composition``, ``tenant``. Raising an existing budget
keeps every field the body does not name at the budget's current value (raise ``epsilon_total``
alone and ``delta_total`` and the composition stay as they are); a new budget needs
``epsilon_total`` and defaults to ``delta_total = 0`` and ``fsrc``. An unknown field is a 400 that
names it (and the nearest known one): ``epsilon_totl`` must not leave the total unchanged. A
budget's tenant never changes.
"""

from __future__ import annotations

import difflib

from .errors import ApiError

FIELDS = ("epsilon_total", "delta_total", "composition", "tenant")


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{field}: {message}", param=field)


def budget_update(name: str, body: dict, current) -> dict:
    """The ``Ledger.set_budget`` arguments for ``body`` applied to ``current`` (a ``BudgetState``,
    None for a new budget): named fields replace, the others are kept."""
    for key in body:
        if key not in FIELDS:
            near = difflib.get_close_matches(key, FIELDS, n=1)
            raise _bad(key, "unknown field" + (f"; did you mean {near[0]!r}?" if near else
                                                f"; known fields: {', '.join(FIELDS)}"))
    if current is None and "epsilon_total" not in body:
        raise _bad("epsilon_total", f"a new budget {name!r} needs one")
    out = ({"epsilon_total": None, "delta_total": 0.0, "composition": "fsrc", "tenant": None} if current is None else
           {"epsilon_total": current.total.epsilon, "delta_total": current.total.delta,
            "composition": current.composition, "tenant": current.tenant})
    for key in ("epsilon_total", "delta_total"):
        if key in body:
            v = body[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _bad(key, f"must be a number, got {v!r}")
            out[key] = float(v)
    if "composition" in body:
        out["composition"] = body["composition"]
    if "tenant" in body:
        if body["tenant"] is not None and not isinstance(body["tenant"], str):
            raise _bad("tenant", f"must be a string, got {body['tenant']!r}")
        if current is not None and body["tenant"] != current.tenant:
            raise _bad("tenant", f"budget {name!r} belongs to tenant {current.tenant!r}; a budget's tenant never "
                                 f"changes (got {body['tenant']!r})")
        out["tenant"] = body["tenant"]
    return out
