"""Predict latency per tenant, as the gateways measured it: their reports (``nexus_qos_report``) add up here
into one :class:`~nexus.wire.qos.LatencyHistogram` per tenant, shown on ``/metrics``
(``nexus_predict_latency_seconds``, ``nexus_predict_rejected_total``) and on the ``/nexus`` page.

Plain data on the scheduler's loop: a report is a few hundred integers, added in microseconds.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from nexus.errors import SpecError
from nexus.wire.qos import LatencyHistogram

MAX_TENANTS_PER_REPORT = 4096


class PredictLatency:
    def __init__(self) -> None:
        self.tenants: dict[str, LatencyHistogram] = defaultdict(LatencyHistogram)
        self.reports = 0

    async def report(self, report: dict[str, Any]) -> bool:
        """Handler ``nexus_qos_report``: add a gateway's histograms (``{"tenants": {name: histogram}}``)."""
        tenants = report.get("tenants") if isinstance(report, dict) else None
        if not isinstance(tenants, dict) or len(tenants) > MAX_TENANTS_PER_REPORT:
            raise SpecError("a qos report is {'tenants': {name: histogram}} for at most "
                            f"{MAX_TENANTS_PER_REPORT} tenants")
        try:
            parsed = {str(t): LatencyHistogram.from_dict(h) for t, h in tenants.items()}
        except (ValueError, TypeError, AttributeError) as e:
            raise SpecError(f"a qos report's histogram is malformed: {e}") from None
        for t, h in parsed.items():
            self.tenants[t].add(h)
        self.reports += 1
        return True

    def drop(self, tenant: str) -> None:
        self.tenants.pop(tenant, None)

    def rows(self) -> list[dict[str, Any]]:
        """One row per tenant: predicts answered, refused (429), mean, p50 and p99 in ms (from the buckets)."""
        return [{"tenant": t, **h.summary()} for t, h in sorted(self.tenants.items())]

    def prometheus(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        hist = HistogramMetricFamily("nexus_predict_latency_seconds", "Predict latency at the gateway per tenant "
                                     "(request in to answer out)", labels=["tenant"])
        rejected = CounterMetricFamily("nexus_predict_rejected", "Predicts refused with 429 (a concurrency "
                                       "budget spent) per tenant", labels=["tenant"])
        for t, h in sorted(self.tenants.items()):
            hist.add_metric([t], h.cumulative(), h.sum_s)
            rejected.add_metric([t], h.rejected)
        return [hist, rejected]
