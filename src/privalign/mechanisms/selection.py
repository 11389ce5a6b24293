"""The result of one selection."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Selection:
    """What a mechanism chose and what it cost.

    index:        0-based index of the chosen candidate (into the Phase-2 candidates for PrivITP);
                  ``None`` when ``fallback`` is set.
    fallback:     ITP/PrivITP accepted no candidate; the caller must return a *fresh* draw from
                  the base policy (SPEC), which costs one more generation.
    halting_time: ITP/PrivITP: the round t of acceptance, or n + 1 for the fallback (PrivITP:
                  T + 1, T = ``max_rounds``), i.e. the number of (Phase-2) generations used;
                  ``None`` for BoN/PrivBoN.
    max_rounds:   PrivITP: T, the most Phase-2 rounds (n unless capped).
    epsilon, delta: the privacy spent by this selection (ex-post for PrivITP); BoN and ITP are
                  not private (epsilon = inf).
    """

    index: int | None
    mechanism: str
    epsilon: float
    delta: float = 0.0
    fallback: bool = False
    halting_time: int | None = None
    n: int = 0
    max_rounds: int | None = None
    noise_scale: float | None = None
    lambda_: float | None = None
    lambda_tilde: float | None = None
    sigma_x: float | None = None
    sigma_z: float | None = None
    truncation: float | None = None
    epsilon_1: float | None = None
    epsilon_2: float | None = None
    n_clipped: int = 0

    def as_dict(self) -> dict:
        return asdict(self)
