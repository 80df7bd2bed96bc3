"""The emulated-device tool: the real service with device work that takes calibrated time (:mod:`.settings`).

A package apart: it depends on ``nexus``; nothing in ``nexus`` imports it (``tests/test_emulator_apart.py``). It
plugs into the service through one seam, :mod:`nexus.wire.devices`, from a worker preload
(:mod:`.worker`); :mod:`.service` starts an emulated local service, :mod:`.cli` is its ``up`` command."""
