"""The shared, frozen vision-language backbone and its grouped forward.

Two families: Qwen3-VL (``nexus.model.qwen3vl``, StarVLA's backbones) and PaliGemma
(``nexus.model.paligemma``, OpenPI's). Every process that needs features (actor workers, inference
workers) builds its own copy; offline presets are built from configs with random weights under a
fixed seed, so equal configs give bit-identical weights in every process; ``local_path`` loads a real
checkpoint from disk (never from a hub).

The group-batching compatibility rule (:func:`compatible`) is explicit: two requests may share one
backbone forward iff their compat keys are equal — same family, same weights (offline size preset or
checkpoint path), same dtype, same image size (the processor setting that shapes the prefix).
Everything else may differ between them: tenant, number / names / raw sizes of cameras, instruction
and its length, proprio and action dimensions, the action-module family that reads the result, and
the tenant's LoRA adapter (any rank, or none): adapters are applied per row inside the shared forward
(``nexus.model.lora``), so they never split a group.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nexus.config.service import BackboneConfig
from nexus.features import VLAFeature
from nexus.model.backbone_features import BackboneFeatures
from nexus.model.lora import AdapterRouter, TenantAdapter, lora_shapes
from nexus.model.prefix_cache import PrefixCache

__all__ = ["BackboneConfig", "SharedBackbone", "check", "compatible", "family", "model_key_of"]

_FAMILIES = {"qwen3vl": "nexus.model.qwen3vl:Qwen3VLFamily", "paligemma": "nexus.model.paligemma:PaliGemmaFamily"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def family(name: str) -> Any:
    """The adapter class of a backbone family (prompt format, presets, input preparation, forward)."""
    if name not in _FAMILIES:
        raise ValueError(f"unknown backbone family {name!r} (supported: {sorted(_FAMILIES)})")
    module, cls = _FAMILIES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def check(cfg: BackboneConfig) -> BackboneConfig:
    """``cfg`` if its family can build it: an offline preset the family has, an image size its patches
    divide (the checks that need the family's code; ``BackboneConfig`` itself checks the rest)."""
    fam = family(cfg.family)
    if cfg.local_path is None and cfg.size not in fam.sizes:
        raise ValueError(f"unknown {cfg.family} backbone size {cfg.size!r} (offline presets: {sorted(fam.sizes)})")
    factor = fam.image_factor(None if cfg.local_path else cfg.size)
    if cfg.image_size < factor or (cfg.local_path is None and cfg.image_size % factor):
        raise ValueError(f"image_size must be a positive multiple of {factor} for {cfg.family}, "
                         f"got {cfg.image_size}")
    return cfg


def model_key_of(compat_key: str) -> str:
    """The model part of a compat key (everything before the processor settings)."""
    return compat_key.rsplit("@", 1)[0]


def compatible(a: str, b: str) -> bool:
    """The group-batching rule: requests with compat keys ``a`` and ``b`` may share one forward.

    Equal keys only: same backbone family, weights, dtype and image size. Requests of one model at
    different image sizes run as separate forwards of that model (in the same step); requests for
    another model run on that model's backbone. Tenants' LoRA adapters are not part of the key: rows
    with different adapters (ranks may differ) or none share one forward.
    """
    return a == b


class SharedBackbone:
    """The frozen backbone one process keeps resident; turns groups of VLAFeatures into features.

    ``encode``/``encode_prefix`` hold a lock: the model is shared, and concurrent forwards on the same
    CPU cores only slow each other down. The model is never trained (eval mode, its parameters never
    require grad); tenants' LoRA adapters are applied per row through :attr:`router`, and a forward
    with ``grad=True`` builds the autograd graph that reaches those adapters only.
    """

    def __init__(self, cfg: BackboneConfig) -> None:
        self.cfg = check(cfg)
        self.device = torch.device(cfg.device)
        if cfg.local_path is not None and not os.path.isdir(cfg.local_path):
            # never fall through to a model-hub download
            raise FileNotFoundError(f"backbone local_path {cfg.local_path!r} is not a directory")
        self.family = family(cfg.family)(cfg, _DTYPES[cfg.dtype])
        self.processor = self.family.processor
        self.model = self.family.model.to(dtype=_DTYPES[cfg.dtype], device=self.device).eval()
        self.model.requires_grad_(False)
        self.router = AdapterRouter(self.model)
        self._lock = threading.Lock()
        self._fingerprint: str | None = None
        self.forward_calls = 0  # backbone forwards run (monitoring: group batching efficiency)
        self.samples_encoded = 0  # samples actually sent through the model (after deduplication)

    @property
    def hidden_size(self) -> int:
        return self.family.hidden_size

    @property
    def num_hidden_states(self) -> int:
        """Hidden states a forward can return: the embeddings + one per decoder layer."""
        return self.family.num_hidden_states

    @property
    def compat_key(self) -> str:
        return self.cfg.compat_key()

    def lora_shapes(self, cfg: Any) -> dict[str, tuple[int, int]] | None:
        """Shapes of the projections a tenant's ``LoraConfig`` adapts on this backbone (None: no LoRA)."""
        return None if cfg is None else lora_shapes(self.model, cfg)

    def fingerprint(self) -> str:
        """sha256 over this model's weights (names, dtypes, shapes, values); computed once per process.

        Names the exact backbone an exported policy ran on: a policy loaded elsewhere checks it."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for name, t in sorted(self.model.state_dict().items()):
                t = t.detach().cpu().contiguous()
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
                h.update((t.float() if t.is_floating_point() else t).numpy().tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def accepts(self, compat_key: str) -> bool:
        """Whether features with this key can run on this model (any image size of the same model)."""
        return model_key_of(compat_key) == self.cfg.model_key()

    def normalize_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """Sorted, unique negative indices into the hidden states (-1 = last layer's output)."""
        n = self.num_hidden_states
        out = set()
        for i in layers:
            j = i - n if i >= 0 else i
            if not -n <= j <= -1:
                raise ValueError(f"hidden-state layer {i} out of range for a backbone with {n} hidden states")
            out.add(j)
        return tuple(sorted(out))

    def encode(self, features: list[VLAFeature]) -> torch.Tensor:
        """Pooled features [N, hidden] fp32 of one grouped forward (see :meth:`encode_prefix`)."""
        return self.encode_prefix(features).pooled

    def encode_prefix(self, features: list[VLAFeature], layers: Sequence[int] = (),
                      adapters: Sequence[TenantAdapter | None] | None = None, grad: bool = False,
                      cache: PrefixCache | None = None) -> BackboneFeatures:
        """One grouped forward for all features (equal compat keys) -> :class:`BackboneFeatures`.

        ``adapters`` names each sample's LoRA adapter (None: the base model); ``grad`` keeps the autograd
        graph (only adapters can receive gradients: the backbone's own weights never require them).

        ``pooled`` is the masked mean of the last hidden state; ``layers`` (e.g. ``(-2, -1)``) also
        returns those hidden states over the whole prefix, left-padded, with the padding mask.
        Identical samples (same prompt and same image bytes) are computed once. Left padding and
        per-sample positions make each row independent of the rest of the group (equal to a
        single-sample forward up to float noise, ~1e-7 in fp32). Samples with and without images,
        and with different numbers of images, mix in one forward. With a ``cache`` (an inference engine's,
        whose adapters never change in place; ignored with ``grad``) samples it holds are not computed again.
        """
        layers = self.normalize_layers(layers)
        if not features:
            h = self.hidden_size
            empty = torch.zeros(0, h, device=self.device)
            if not layers:
                return BackboneFeatures(empty)
            return BackboneFeatures(empty, torch.zeros(0, len(layers), 0, h, device=self.device),
                                    torch.zeros(0, 0, dtype=torch.bool, device=self.device), layers)
        keys = {f.compat_key for f in features}
        if len(keys) != 1:
            raise ValueError(f"one grouped forward needs equal compat keys, got {sorted(keys)}")
        key = keys.pop()
        if not self.accepts(key):
            raise ValueError(f"feature compat key {key!r} does not match this backbone ({self.compat_key!r})")
        placeholder = self.family.image_placeholder
        for f in features:
            if f.prompt.count(placeholder) != len(f.images):
                raise ValueError(f"prompt has {f.prompt.count(placeholder)} image placeholders but the "
                                 f"feature carries {len(f.images)} images")

        if adapters is not None and len(adapters) != len(features):
            raise ValueError(f"{len(adapters)} adapters for {len(features)} samples")
        row_adapters = list(adapters) if adapters is not None else [None] * len(features)
        unique: dict[tuple[Any, ...], int] = {}
        rows: list[int] = []
        todo: list[VLAFeature] = []
        todo_adapters: list[TenantAdapter | None] = []
        for f, a in zip(features, row_adapters, strict=True):
            k = (_sample_key(f), id(a) if a is not None else 0)  # the same sample under another adapter differs
            if k not in unique:
                unique[k] = len(todo)
                todo.append(f)
                todo_adapters.append(a)
            rows.append(unique[k])

        if any(a is not None for a in todo_adapters):  # rows of one adapter contiguous (S-LoRA's layout)
            first: dict[int, int] = {}
            for a in todo_adapters:
                first.setdefault(id(a), len(first))
            order = sorted(range(len(todo)), key=lambda i: first[id(todo_adapters[i])])
            position = {old: new for new, old in enumerate(order)}
            todo, todo_adapters = [todo[i] for i in order], [todo_adapters[i] for i in order]
            rows = [position[r] for r in rows]

        if cache is not None and not grad:
            out = self._cached(todo, todo_adapters, layers, cache)
        else:
            out = self._run(todo, todo_adapters, layers, grad)
        if rows != list(range(len(todo))):
            out = out[rows]
        return out

    def _run(self, todo: list[VLAFeature], adapters: list[TenantAdapter | None], layers: tuple[int, ...],
             grad: bool) -> BackboneFeatures:
        batch = self.family.prepare(todo)  # tokenization + image patching: outside the lock
        with self._lock, self.router.route(adapters, self.device):
            out = self._forward(batch, layers, grad)
            self.forward_calls += 1
            self.samples_encoded += len(todo)
        return out

    def _cached(self, todo: list[VLAFeature], adapters: list[TenantAdapter | None], layers: tuple[int, ...],
                cache: PrefixCache) -> BackboneFeatures:
        """The rows the cache holds from it, the others from one forward (then kept)."""
        keys = [cache.key(f.compat_key, f.prompt, len(f.images), a) for f, a in zip(todo, adapters, strict=True)]
        found = [None if k is None else cache.get(k, layers) for k in keys]
        miss = [i for i, f in enumerate(found) if f is None]
        if not miss:
            return found[0] if len(found) == 1 else BackboneFeatures.cat(found)  # type: ignore[arg-type]
        computed = self._run([todo[i] for i in miss], [adapters[i] for i in miss], layers, False)
        for j, i in enumerate(miss):
            if keys[i] is not None:
                cache.put(keys[i], computed[j])
        if len(miss) == len(todo):
            return computed
        for j, i in enumerate(miss):
            found[i] = computed[j]
        return BackboneFeatures.cat(found)  # type: ignore[arg-type]

    def _forward(self, batch: dict[str, Any], layers: tuple[int, ...], grad: bool = False) -> BackboneFeatures:
        with torch.set_grad_enabled(grad):
            return self._features(batch, layers)

    def _features(self, batch: dict[str, Any], layers: tuple[int, ...]) -> BackboneFeatures:
        hidden, attn = self.family.forward(batch, self.device, hidden_states=bool(layers))
        last = hidden[-1].float()
        mask = attn.to(torch.bool)
        m = mask.unsqueeze(-1).to(last.dtype)
        pooled = (last * m).sum(1) / m.sum(1)
        if not layers:
            return BackboneFeatures(pooled)
        tokens = torch.stack([hidden[i].float() for i in layers], dim=1)
        return BackboneFeatures(pooled, tokens, mask, layers)


def _sample_key(f: VLAFeature) -> tuple[Any, ...]:
    """Identity of a sample's backbone input (prompt + image content) for deduplication."""
    digests = tuple(hashlib.blake2b(np.ascontiguousarray(img).tobytes(), digest_size=16,
                                    person=str(img.shape).encode()[:16]).digest() for img in f.images)
    return (f.prompt, digests)
