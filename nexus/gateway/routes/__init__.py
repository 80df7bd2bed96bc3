"""The gateway's HTTP API, one ``APIRouter`` per resource; :func:`nexus.gateway.app.create_app` assembles them
in :data:`ROUTERS`'s order (the order of the OpenAPI document's paths).

* :mod:`~nexus.gateway.routes.service`: ``/health``, ``/v1/status``
* :mod:`~nexus.gateway.routes.tenants`: ``/v1/tenants`` (create, view, delete, logs, export)
* :mod:`~nexus.gateway.routes.files`: a tenant's output dir
* :mod:`~nexus.gateway.routes.jobs`: submit, view, wait, stream, cancel
* :mod:`~nexus.gateway.routes.low_level`: forward_backward, forward, optim_step, save/load_state, save_weights
* :mod:`~nexus.gateway.routes.predict`: predict
* :mod:`nexus.gateway.envs`: environment sessions, predict_batch, uploaded episodes
* :mod:`~nexus.gateway.routes.admin`: the operator's calls
"""

from __future__ import annotations

from fastapi import APIRouter

from nexus.gateway import envs
from nexus.gateway.routes import admin, files, jobs, low_level, predict, service, tenants

ROUTERS: tuple[APIRouter, ...] = (service.router, tenants.router, files.router, jobs.router, low_level.router,
                                  predict.router, envs.router, admin.router)

__all__ = ["ROUTERS"]
