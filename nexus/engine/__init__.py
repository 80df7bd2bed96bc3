"""Inference Model Service, worker side (resource ``INFER``): the engine with its inference queue and group-batching
rule, every tenant's live and pinned heads, the request gate and statistics."""
