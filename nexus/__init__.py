"""JoyNexus: a multi-tenant post-training service for vision-language-action robot policies.

Importing ``nexus`` is cheap and never imports torch: the scheduler process imports the
control-plane modules only (spec, catalog, queues, scheduler_plugin).
"""

__version__ = "0.1.0"
