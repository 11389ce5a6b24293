"""The service's Prometheus metrics: per-process counters and histograms (queries, refusals,
epsilon charged, latency, ledger time, overload), the merged batches' gauges, and the budgets' gauges
read from the ledger at each scrape (``LedgerCollector``)."""

from __future__ import annotations

from ..ledger import Ledger


class LedgerCollector:
    """Prometheus gauges read from the ledger at each scrape, so /metrics says exactly what
    /v1/budgets says, whichever replica charged: per budget its epsilon and delta total, spent,
    reserved and remaining, and under zcdp its rho."""

    FIELDS = ("epsilon_total", "epsilon_spent", "epsilon_reserved", "epsilon_remaining", "delta_total",
              "delta_spent", "delta_remaining", "rho_total", "rho_spent", "rho_reserved", "rho_remaining")

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        families = {f: GaugeMetricFamily(f"privalign_budget_{f}", f"the budget's {f.replace('_', ' ')} (ledger)",
                                         labels=["budget"]) for f in self.FIELDS}
        try:
            states = self.ledger.budgets()
        except Exception:  # the ledger is failing: no gauges this scrape (the request counters still answer)
            states = []
        for b in states:
            d = b.as_dict()
            for f, family in families.items():
                if d.get(f) is not None:
                    family.add_metric([b.name], float(d[f]))
        yield from families.values()


class ServiceMetrics:
    """The metrics of one ``Service`` process, in their own ``registry`` (what /metrics serves)."""

    def __init__(self, ledger: Ledger, generator, reward):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.queries = Counter("privalign_queries", "answered queries", ["budget", "mechanism"], registry=self.registry)
        self.refusals = Counter("privalign_refusals", "queries refused for lack of budget", ["budget"],
                                registry=self.registry)
        # the sum of answered queries' epsilon_charged; what a budget has spent (under zcdp the conversion
        # of its rho, not this sum) is privalign_budget_epsilon_spent, read from the ledger at each scrape
        self.epsilon = Counter("privalign_epsilon_charged", "sum of answered queries' epsilon_charged (this "
                               "process)", ["budget"], registry=self.registry)
        self.collector = LedgerCollector(ledger)
        self.registry.register(self.collector)
        self.candidates = Counter("privalign_candidates_generated", "candidates generated", registry=self.registry)
        self.latency = Histogram("privalign_request_seconds", "latency of answered queries", registry=self.registry,
                                 buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30))
        self._metric_children: dict = {}
        self.overloaded = Counter("privalign_overloaded", "requests refused (503) because the backend's "
                                  "queue was full", registry=self.registry)
        self.ledger_seconds = Histogram("privalign_ledger_seconds", "time in ledger transactions", registry=self.registry,
                                        buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))
        self.ledger_faults = Counter("privalign_ledger_unavailable", "requests refused (503) because the "
                                     "ledger could not reserve", registry=self.registry)
        for part, label in ((generator, "generate"), (reward, "score")):
            batcher = getattr(part, "batcher", None)
            if batcher is not None:  # merged calls that failed and were rerun member by member (issue 22)
                Gauge(f"privalign_{label}_batch_retried", f"{label} calls rerun alone after their merged call "
                      "failed", registry=self.registry).set_function(lambda b=batcher: b.retried)
                Gauge(f"privalign_{label}_batches", f"batched {label} calls that succeeded",
                      registry=self.registry).set_function(lambda b=batcher: b.batches)

    def children(self, budget: str, mechanism: str):
        """The labelled metric children of a (budget, mechanism), bound once."""
        key = (budget, mechanism)
        if key not in self._metric_children:
            self._metric_children[key] = (self.queries.labels(budget, mechanism), self.epsilon.labels(budget))
        return self._metric_children[key]
