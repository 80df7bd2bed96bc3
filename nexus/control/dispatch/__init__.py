"""Queues and dispatch: the training queue, its dispatcher and admission, the simulators' fair share, routing to
engines, adaptive decisions and the running scheduler."""
