"""JoyNexus: a multi-tenant post-training service for vision-language-action robot policies.

Layers: ``nexus.control`` (scheduler side: never imports torch), ``nexus.services`` (worker side),
``nexus.model`` / ``nexus.algorithms`` (what workers compute), ``nexus.data`` (what they read and write),
``nexus.client`` (what a tenant runs). ``spec``, ``config``, ``features``, ``catalog`` and ``signals``
are plain shared types. Importing ``nexus`` is cheap and never imports torch.
"""

__version__ = "0.1.0"
