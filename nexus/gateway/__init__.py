"""The tenant gateway: HTTP + JSON (FastAPI + uvicorn), tokens, and one adapter to the Dask service.

``python -m nexus.gateway --config ROOT/service.json`` runs it (``nexus.deploy.local`` starts it next to the
scheduler); :mod:`nexus.gateway.routes` holds the routes, one router per resource, which
:mod:`nexus.gateway.app` assembles; :mod:`nexus.gateway.auth` the tokens and
:mod:`nexus.gateway.backend` every call into the service; :mod:`nexus.gateway.fast_predict` serves the hottest
route, predict, past FastAPI's machinery; :mod:`nexus.gateway.openpi` serves robots on openpi's WebSocket protocol
from the same process.
"""
