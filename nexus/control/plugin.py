"""NexusPlugin: the Dask shell of the Master Service — its handler table and its Dask hooks.

Everything else lives in the control plane's parts (:mod:`nexus.control.master` wires them). Rules:
nothing blocking runs on the scheduler's event loop (no file I/O, no MLflow) and torch is never
imported here; worker functions are named by import path (:mod:`nexus.control.tasks`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import click
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

from nexus.config.service import ServiceConfig
from nexus.control.master import Master
from nexus.control.monitoring import dashboard
from nexus.control.monitoring.predict_latency import PredictLatency
from nexus.control.monitoring.state import TOPIC, PrometheusCollector
from nexus.control.tenants.env_sessions import EnvSessions
from nexus.errors import SpecError
from nexus.wire.dask_streams import send_promptly
from nexus.wire.messages import HEALTH_TOPIC

logger = logging.getLogger("nexus.scheduler")


class NexusPlugin(SchedulerPlugin):
    name = "nexus"

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.scheduler = None
        self.master: Master | None = None
        self.env_sessions: EnvSessions | None = None
        self.latency = PredictLatency()  # predict latency per tenant, from the gateways' reports

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        for stream in scheduler.stream_comms.values():  # workers that joined before the plugin (add_worker: later)
            send_promptly(stream)
        m = self.master = Master(self.config, scheduler)
        envs = self.env_sessions = EnvSessions(m.runtime, m.registry, lambda t: m.config.limits_for(t))
        scheduler.handlers.update({
            # stable contract (names and argument shapes)
            "nexus_create_tenant": m.create_tenant,
            "nexus_submit": m.submit,
            "nexus_job": m.job,
            "nexus_wait": m.wait,
            "nexus_status": m.status,
            "nexus_op": m.op,
            "nexus_flush": m.flush,
            "nexus_monitoring": m.monitoring_view,
            "nexus_tenant_log": m.tenant_log,
            # lifecycle, elasticity, routing
            "nexus_cancel": m.cancel,
            "nexus_delete_tenant": m.delete_tenant,
            "nexus_scale_inference": m.scale_inference,
            "nexus_route": m.route,
            "nexus_engines": m.engines,
            "nexus_wait_ready": m.wait_ready,
            "nexus_export": m.export,
            "nexus_end_sessions": m.end_sessions,
            "nexus_accounting": m.accounting,
            "nexus_scheduling": m.scheduling,
            "nexus_set_scheduler": m.set_scheduler,
            "nexus_offload": m.offload.now,  # idle tenants' actor slots to disk now (operators, benchmarks)
            # environment sessions (tenants' own algorithms on the service's simulators)
            "nexus_env_open": envs.open,
            "nexus_env_close": envs.close,
            "nexus_env_sessions": envs.view,
            "nexus_feed_rollouts": m.jobs.external.feed,  # an upload of a tenant's own episodes, stored
            "nexus_qos_report": self.latency.report,  # the gateways' predict latency histograms
        })
        scheduler.get_task_stream(count=0)  # record task start/stops from the start (dashboard, metering checks)
        for address in scheduler.workers:  # workers that joined before the plugin
            m.supervisor.on_worker_added(address)
        m.start()
        _register_prometheus(self)
        http = getattr(scheduler, "http_application", None)
        if http is not None:  # JSON view of the service next to the dashboard
            http.add_handlers(r".*", [(r"/nexus/api/state", _StateHandler, {"plugin": self})])
        logger.info("Nexus plugin started on %s (service root %s)", scheduler.address, self.config.root)

    async def close(self) -> None:
        if self.master is not None:
            await self.master.close()

    # -- Dask hooks ---------------------------------------------------------------------------------------
    def add_worker(self, scheduler, worker: str) -> None:
        send_promptly(scheduler.stream_comms.get(worker))  # the scheduler's stream to it: tasks to run
        if self.master is not None:
            self.master.supervisor.on_worker_added(worker)

    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        if self.master is not None:
            self.master.supervisor.on_worker_removed(worker)
            self.env_sessions.on_worker_removed(worker)

    def restart(self, scheduler) -> None:
        if self.master is not None:
            self.master.supervisor.on_restart()

    def log_event(self, topic: str, msg: Any) -> None:
        if self.master is None or not isinstance(msg, dict):
            return
        if topic == TOPIC:
            self.master.monitoring.ingest(msg)
        elif topic == HEALTH_TOPIC:
            self.master.supervisor.on_heartbeat(msg)
            self.env_sessions.on_heartbeat(msg)

    # -- views used in-process (dashboard page, Prometheus, JSON route, tests) ------------------------------
    def status(self, limit: int | None = None, cursor: str | None = None) -> dict[str, Any]:
        return self.master.status(limit, cursor)

    def monitoring_view(self, since: float = 0.0, limit: int | None = None,
                        cursor: str | None = None) -> dict[str, Any]:
        return self.master.monitoring_view(since, limit, cursor)

    @property
    def monitoring(self):
        return self.master.monitoring

    @property
    def jobs(self):
        return self.master.jobs.jobs

    @property
    def queue(self):
        return self.master.queue


class _StateHandler(web.RequestHandler):
    def initialize(self, plugin: NexusPlugin) -> None:
        self.plugin = plugin

    def get(self) -> None:
        """``/nexus/api/state?limit=N&cursor=C``: one page of the status."""
        self.set_header("Content-Type", "application/json")
        limit = self.get_query_argument("limit", None)
        try:
            st = self.plugin.status(int(limit) if limit and limit.isdigit() else limit,
                                    self.get_query_argument("cursor", None))
        except SpecError as e:
            self.set_status(422)
            st = {"error": str(e)}
        self.write(json.dumps(st, default=str))


_prometheus_registered: list[PrometheusCollector] = []


def _register_prometheus(plugin: NexusPlugin) -> None:
    """One collector per scheduler process, pointing at the newest plugin."""
    import prometheus_client

    if _prometheus_registered:
        _prometheus_registered[0].plugin = plugin
        return
    collector = PrometheusCollector(plugin)
    prometheus_client.REGISTRY.register(collector)
    _prometheus_registered.append(collector)


dashboard.register()  # at import (preload), before the scheduler builds its dashboard


def log_to_stderr() -> None:
    """Nexus's loggers write next to Dask's in the process's log (once per process)."""
    root = logging.getLogger("nexus")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


@click.command(help="the Nexus plugin of `dask scheduler --preload nexus.control.plugin --nexus-config PATH`")
@click.option("--nexus-config", "config_path", default=None, type=click.Path(dir_okay=False),
              help="the service's service.json (default: $NEXUS_SERVICE_CONFIG)")
def dask_setup(scheduler, config_path: str | None) -> None:
    """Entry point of ``dask scheduler --preload nexus.control.plugin --nexus-config ROOT/service.json``.

    Without a readable config the scheduler closes (Dask only logs a failed preload: a scheduler without
    its plugin would take workers and serve nothing)."""
    log_to_stderr()
    try:
        config = ServiceConfig.load(config_path)
    except Exception as e:
        logger.error("no Nexus service config (%s): %s; closing the scheduler", config_path, e)
        scheduler.loop.add_callback(scheduler.close, reason="nexus-no-config")
        raise
    scheduler.add_plugin(NexusPlugin(config))
