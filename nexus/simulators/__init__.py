"""Simulator back-ends of the Environment Service, one module per simulator family.

Every module imports its simulator lazily (inside functions), so importing the package is cheap and
control-plane processes may reference it. The public entry points are in
:mod:`nexus.services.environment` (``make_env``, ``collect_episodes``).
"""
