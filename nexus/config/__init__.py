"""Settings read from TOML: the service's sections (``service``), the schedulers catalog (``scheduling``), the env and
dataset catalogs (``catalog``), the tenant-facing validation of specs against them (``validation``) and the paths
the service owns (``paths``)."""
