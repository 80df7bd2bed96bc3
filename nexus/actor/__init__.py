"""Training Model Service, worker side (resource ``ACTOR``): the frozen backbone and every tenant's slot (head, value
head, LoRA adapter, DeepSpeed ZeRO engine, version), the tasks the control plane sends, low-level ops and export."""
