"""Deployments: the embedded one-host cluster (``local``), separate hosts (``hosts``), the command line of each process
(``processes``), mutual TLS and the predict path's GC settings."""
