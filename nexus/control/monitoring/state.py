"""Monitoring: the three kinds of signals of the paper, and per-tenant metering.

Workers emit signals asynchronously as Dask events on the topic ``nexus-signal`` (:func:`nexus.wire.signals.emit`);
the scheduler plugin feeds every event to :class:`MonitoringState` (plain data, no I/O), which the
dashboard page, the JSON route, Prometheus and the CLI read.

* control — queue depth per queue and tenant, in-flight, versions and staleness (sampled by the plugin)
* learning — losses, returns, success rates (job histories, MLflow)
* system — worker health, weight-sync time and bytes, busy time per service, inference group sizes/waits

Metering (beyond the paper): every device-second a service spends is charged to a tenant — an
update on the actor to its tenant, a rollout on a simulator to its tenant, and each grouped inference
forward split over the tenants by their share of the group's requests — so the charges of a service
add up to its measured busy time.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from nexus.control.health.manager import prometheus_families
from nexus.wire.signals import SERVICES, TOPIC

__all__ = ["SERVICES", "TOPIC", "MonitoringState", "PrometheusCollector", "Span"]


@dataclass
class Span:
    service: str
    worker: str
    tenant: str
    t0: float
    t1: float
    what: str = ""
    sim_s: float = 0.0  # simulator spans: stepping ...
    wait_s: float = 0.0  # ... and waiting for actions, inside [t0, t1]
    lent_s: float = 0.0  # ... of the stepping, what ran on devices another service lent
    lent_missed_s: float = 0.0  # ... and its owner's work heard of too late to push those steps back


@dataclass
class MonitoringState:
    horizon: int = 2000  # spans and samples kept for the page
    metered: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    metered_jobs: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    busy: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # service -> measured busy s
    # the execution timeline: enough for a benchmark's runs (inference groups are the most numerous)
    spans: deque = field(default_factory=lambda: deque(maxlen=50_000))
    samples: deque = field(default_factory=lambda: deque(maxlen=2000))  # control signals over time
    group_sizes: deque = field(default_factory=lambda: deque(maxlen=5000))
    group_waits: deque = field(default_factory=lambda: deque(maxlen=5000))
    weight_sync: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    # tenant -> simulator time split: sim_s (stepping) and action_wait_s (waiting for actions)
    simulator_split: dict[str, dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # (service, worker) -> busy seconds since the start (status's accounting, without walking the spans)
    busy_slot: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    inference_pending: int = 0
    t_start: float = field(default_factory=time.time)

    def ingest(self, msg: dict[str, Any]) -> None:
        """One worker signal; unknown kinds are counted and otherwise ignored."""
        kind = msg.get("kind", "")
        self.counts[kind] += 1
        # the slot charged: the sending worker (Dask stamps its address), or the device a worker holding several
        # names (nexus.wire.devices.slot_label)
        slot = str(msg.get("device") or msg.get("worker"))
        if kind in ("update", "rollout"):
            service = "actor" if kind == "update" else "simulator"
            seconds = float(msg["t1"]) - float(msg["t0"])
            self.metered[msg["tenant"]][service] += seconds
            if msg.get("job"):
                self.metered_jobs[msg["job"]][service] += seconds
            self.busy[service] += seconds
            self.busy_slot[(service, slot)] += seconds
            self.spans.append(Span(service, slot, msg["tenant"], msg["t0"], msg["t1"],
                                   msg.get("what", kind), float(msg.get("sim_s", 0.0)),
                                   float(msg.get("action_wait_s", 0.0)), float(msg.get("lent_s", 0.0)),
                                   float(msg.get("lent_missed_s", 0.0))))
            if kind == "rollout" and "sim_s" in msg:  # datapath: stepping vs waiting for actions
                split = self.simulator_split[msg["tenant"]]
                split["sim_s"] += float(msg["sim_s"])
                split["action_wait_s"] += float(msg.get("action_wait_s", 0.0))
            if kind == "update" and msg.get("sync_bytes"):  # datapath: only versions actually pushed
                ws = self.weight_sync[msg["tenant"]]
                ws["count"] += 1
                ws["seconds"] += float(msg.get("sync_s", 0.0))
                ws["bytes"] += float(msg["sync_bytes"])
        elif kind == "env":  # environment sessions: simulator seconds of a tenant's own algorithm
            seconds, t1, worker = float(msg["busy_s"]), float(msg["t1"]), str(msg["worker"])
            self.metered[msg["tenant"]]["simulator"] += seconds
            self.busy["simulator"] += seconds
            self.busy_slot[("simulator", worker)] += seconds
            # one span per report (about a second of calls), as long as their busy time
            self.spans.append(Span("simulator", worker, msg["tenant"], t1 - seconds, t1, "env", seconds, 0.0))
        elif kind == "inference":
            self.busy["inference"] += float(msg["busy_s"])
            for tenant, s in msg["by_tenant"].items():
                self.metered[tenant]["inference"] += float(s)
            for job, s in msg.get("by_job", {}).items():
                self.metered_jobs[job]["inference"] += float(s)
            for t0, t1, tenants in msg.get("spans", ()):
                self.busy_slot[("inference", slot)] += float(t1) - float(t0)
                self.spans.append(Span("inference", slot, "+".join(sorted(tenants)), t0, t1, "group"))
            self.group_sizes.extend(msg.get("sizes", ()))
            self.group_waits.extend(msg.get("waits", ()))
            self.counts["inference_groups"] += len(msg.get("sizes", ()))
            self.inference_pending = int(msg.get("pending", 0))

    def sample(self, row: dict[str, Any]) -> None:
        self.samples.append({"t": time.time(), **row})

    def metering_table(self) -> dict[str, dict[str, float]]:
        return {t: {s: round(v.get(s, 0.0), 6) for s in SERVICES} for t, v in self.metered.items()}

    def tenant_metering(self, tenant: str) -> dict[str, float]:
        per = self.metered.get(tenant, {})
        return {s: round(per.get(s, 0.0), 6) for s in SERVICES}

    def job_metering(self, job: str) -> dict[str, float]:
        per = self.metered_jobs.get(job, {})
        return {s: round(per.get(s, 0.0), 6) for s in SERVICES}

    def accounting(self, slots: dict[str, list[str]], t0: float | None = None, t1: float | None = None,
                   aliases: dict[str, str] | None = None) -> dict[str, Any]:
        """Device time and utilization of each service over ``[t0, t1]`` from the recorded spans."""
        return accounting(list(self.spans), slots, self.t_start if t0 is None else t0,
                          time.time() if t1 is None else t1, aliases)

    def totals(self, slots: dict[str, list[str]], aliases: dict[str, str] | None = None) -> dict[str, Any]:
        """The accounting since the service started from running sums (cheap: ``status()`` calls it)."""
        wall = max(time.time() - self.t_start, 0.0)
        al = aliases or {}
        busy_slot: dict[tuple[str, str], float] = defaultdict(float)
        for (service, w), v in self.busy_slot.items():
            busy_slot[(service, al.get(w, w))] += v
        out: dict[str, Any] = {"t0": self.t_start, "wall_s": wall, "services": {}}
        dev = busy_all = 0.0
        for service in SERVICES:
            workers = set(slots.get(service, [])) | {w for s, w in busy_slot if s == service}
            busy = {w: min(busy_slot.get((service, w), 0.0), wall) for w in sorted(workers)}
            device = len(workers) * wall
            row: dict[str, Any] = {"slots": len(workers), "device_s": device, "busy_s": sum(busy.values()),
                                   "busy_per_slot_s": busy,
                                   "utilization": sum(busy.values()) / device if device > 0 else 0.0}
            if service == "simulator":
                row["split_s"] = {"stepping": sum(v.get("sim_s", 0.0) for v in self.simulator_split.values()),
                                  "waiting_for_actions": sum(v.get("action_wait_s", 0.0)
                                                             for v in self.simulator_split.values())}
            out["services"][service] = row
            dev, busy_all = dev + device, busy_all + row["busy_s"]
        out["device_s"], out["utilization"] = dev, busy_all / dev if dev > 0 else 0.0
        return out

    def _spans_since(self, since: float, tenants: set[str] | None) -> list[dict[str, Any]]:
        """The newest ``horizon`` spans ending after ``since`` (of ``tenants``: an inference group's span names
        every tenant it served, joined by '+')."""
        out: list[dict[str, Any]] = []
        for sp in reversed(self.spans):
            if len(out) >= self.horizon:
                break
            if sp.t1 >= since and (tenants is None or tenants.intersection(sp.tenant.split("+"))):
                out.append(vars(sp))
        return out[::-1]

    def snapshot(self, since: float = 0.0, tenants: list[str] | None = None) -> dict[str, Any]:
        """The signals since ``since``; the per-tenant ones of ``tenants`` only (default: all), so a page of
        the monitoring view stays the size of its page."""
        keep = None if tenants is None else set(tenants)

        def mine(d: dict) -> dict:
            return {t: v for t, v in d.items() if keep is None or t in keep}

        samples = [s for s in self.samples if s["t"] >= since]
        if keep is not None:
            samples = [{**s, "by_tenant": mine(s.get("by_tenant", {})), "lag": mine(s.get("lag", {}))}
                       for s in samples]
        return {
            "t_start": self.t_start,
            "metering": mine(self.metering_table()),
            "busy": {s: self.busy.get(s, 0.0) for s in SERVICES},
            "spans": self._spans_since(since, keep),
            "samples": samples,
            "group_sizes": list(self.group_sizes),
            "group_waits": list(self.group_waits),
            "weight_sync": {t: dict(v) for t, v in mine(self.weight_sync).items()},
            "simulator_split": {t: dict(v) for t, v in mine(self.simulator_split).items()},
            "signals": dict(self.counts),
        }


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals (a slot busy with two overlapping spans counts once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def accounting(spans: list[Span], slots: dict[str, list[str]], t0: float, t1: float,
               aliases: dict[str, str] | None = None) -> dict[str, Any]:
    """The services' own records turned into the paper's accounting over the window ``[t0, t1]``.

    ``slots``: service -> the workers allocated to it (actor ranks, inference engines, SIM workers); a
    worker seen in the spans but not listed is counted as allocated too; ``aliases`` maps the worker ids
    spans carry (a worker's address) to the names in ``slots``. Per service: busy seconds per
    slot (union of its spans clipped to the window, so busy <= wall), device time = allocated slots x
    wall, utilization = busy / device time; the simulator's busy time split into stepping, waiting for
    actions and the rest (resets, episode writes), pro rata for spans cut by the window.
    """
    wall = max(t1 - t0, 0.0)
    al = aliases or {}
    out: dict[str, Any] = {"t0": t0, "t1": t1, "wall_s": wall, "services": {}}
    total_device = total_busy = 0.0
    for service in SERVICES:
        per: dict[str, list[tuple[float, float]]] = {w: [] for w in slots.get(service, [])}
        stepping = waiting = 0.0
        for sp in spans:
            if sp.service != service:
                continue
            a, b = max(sp.t0, t0), min(sp.t1, t1)
            if b <= a:
                continue
            per.setdefault(al.get(sp.worker, sp.worker), []).append((a, b))
            if service == "simulator" and sp.t1 > sp.t0:
                frac = (b - a) / (sp.t1 - sp.t0)
                stepping += frac * sp.sim_s
                waiting += frac * sp.wait_s
        busy = {w: _union_s(iv) for w, iv in per.items()}
        device = len(per) * wall
        row: dict[str, Any] = {"slots": len(per), "device_s": device, "busy_s": sum(busy.values()),
                               "busy_per_slot_s": busy,
                               "utilization": sum(busy.values()) / device if device > 0 else 0.0,
                               "utilization_per_slot": {w: (b / wall if wall > 0 else 0.0) for w, b in busy.items()}}
        if service == "simulator":
            sb = row["busy_s"]
            stepping, waiting = min(stepping, sb), min(waiting, max(sb - stepping, 0.0))
            row["split_s"] = {"stepping": stepping, "waiting_for_actions": waiting,
                              "other": max(sb - stepping - waiting, 0.0)}
        out["services"][service] = row
        total_device += device
        total_busy += row["busy_s"]
    out["device_s"] = total_device
    out["utilization"] = total_busy / total_device if total_device > 0 else 0.0
    return out


class PrometheusCollector:
    """Control and system signals as Prometheus metrics on the scheduler's ``/metrics``."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self.plugin
        st = p.status()
        g = {name: GaugeMetricFamily(f"nexus_{name}", doc, labels=labels) for name, doc, labels in (
            ("tenant_version", "Policy version per tenant", ["tenant"]),
            ("tenant_inflight", "Training items admitted (reserved + queued + running)", ["tenant"]),
            ("queue_depth", "Items waiting per queue and tenant", ["queue", "tenant"]),
            ("queue_version_lag", "Largest version lag of a tenant's queued RL batches", ["tenant"]),
            ("worker_seconds_since_heartbeat", "Seconds since a worker's last heartbeat", ["worker"]),
        )}
        c = {name: CounterMetricFamily(f"nexus_{name}", doc, labels=labels) for name, doc, labels in (
            ("stale_batches_dropped", "RL batches dropped as stale", ["tenant"]),
            ("metered_device_seconds", "Device-seconds charged to a tenant per service", ["tenant", "service"]),
            ("service_busy_seconds", "Measured busy time per service", ["service"]),
            ("weight_sync_bytes", "Bytes of head weights pushed to inference", ["tenant"]),
            ("weight_sync_seconds", "Time spent pushing head weights to inference", ["tenant"]),
            ("inference_groups", "Grouped inference forwards", []),
        )}
        for t in st["tenants"]:
            g["tenant_version"].add_metric([t["tenant"]], t["version"])
            g["tenant_inflight"].add_metric([t["tenant"]], t["inflight"])
            g["queue_depth"].add_metric(["training", t["tenant"]], t["queued"])
            c["stale_batches_dropped"].add_metric([t["tenant"]], t["dropped_stale"])
        for tenant, lag in st["training_queue"]["lag"].items():
            g["queue_version_lag"].add_metric([tenant], lag)
        for w in st["workers"]:
            g["worker_seconds_since_heartbeat"].add_metric([w["name"]], w["since_heartbeat_s"])
        mon = p.monitoring
        for tenant, per in mon.metering_table().items():
            for service, s in per.items():
                c["metered_device_seconds"].add_metric([tenant, service], s)
        for service in SERVICES:
            c["service_busy_seconds"].add_metric([service], mon.busy.get(service, 0.0))
        for tenant, ws in mon.weight_sync.items():
            c["weight_sync_bytes"].add_metric([tenant], ws.get("bytes", 0.0))
            c["weight_sync_seconds"].add_metric([tenant], ws.get("seconds", 0.0))
        c["inference_groups"].add_metric([], mon.counts.get("inference_groups", 0))
        yield from g.values()
        yield from c.values()

        yield from prometheus_families(st.get("roles", []))
        latency = getattr(p, "latency", None)
        if latency is not None:
            yield from latency.prometheus()
