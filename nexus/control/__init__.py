"""Control plane: the scheduler side (Master, queues, monitoring). Never imports torch."""
