"""JoyNexus: a multi-tenant post-training service for vision-language-action robot policies.

The packages by role (``scripts/structure.py`` checks that imports point one way between them):

* what a tenant runs: ``client`` (the HTTP client, CLI, demo) -> ``gateway`` (the HTTP API, the openpi and gRPC
  robot endpoints);
* the control plane, inside the Dask scheduler (never imports torch): ``control`` (``dispatch``, ``health``,
  ``jobs``, ``tenants``, ``monitoring``);
* the worker side, one package per role: ``actor`` (training), ``engine`` (inference, group batching), ``sim``
  (simulators, rollouts, env sessions), ``tracking`` (MLflow), ``worker`` (the Dask shell hosting them);
* what workers compute and store: ``model``, ``algorithms``, ``data``; ``export`` (a policy run without a service);
* shared below them all: ``config`` (settings, schedulers, catalogs, validation), ``wire`` (what crosses between
  processes), ``deploy`` (one host, several hosts, TLS);
* the contract's types at the top level: ``errors``, ``spec``, ``features``;
* a tool apart, which nothing above imports, and its package beside them.

Importing ``nexus`` is cheap and never imports torch.
"""

__version__ = "0.1.0"
