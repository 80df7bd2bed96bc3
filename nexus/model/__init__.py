"""Model side of JoyNexus: shared frozen backbone, tenant preprocessors, action heads, framework."""
