"""Tenants: the registry, lifecycle (create, delete), rediscovery at boot, offloading idle slots and
environment-session placement."""
