"""What the frozen backbone hands to action modules: pooled features and, on request, prefix tokens.

Action-module families need different views of the backbone's output: an OFT head reads one pooled
vector per sample; GR00T- and π-style flow-matching experts attend to the prefix tokens (image +
instruction), π-style ones to several layers. One grouped forward computes the union of what the
tenants in the group asked for; each tenant then gets only its own rows and layers.

Sequences are left-padded (the backbone's convention): selecting rows trims the leading columns that
are padding for every selected row, so a tenant's slice of a grouped forward has exactly the shape
a forward of that tenant alone would have produced.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class BackboneFeatures:
    pooled: torch.Tensor  # [N, H] float32: masked mean of the last hidden state
    tokens: torch.Tensor | None = None  # [N, L, T, H]: hidden states of ``layers``, left-padded
    mask: torch.Tensor | None = None  # [N, T] bool, True for real (non-padding) tokens
    layers: tuple[int, ...] = ()  # negative indices into the backbone's hidden states (-1 = last)

    def __post_init__(self) -> None:
        if (self.tokens is None) != (self.mask is None) or (self.tokens is None) != (not self.layers):
            raise ValueError("tokens, mask and layers come together (or not at all)")
        if self.tokens is not None and self.tokens.shape[1] != len(self.layers):
            raise ValueError(f"tokens hold {self.tokens.shape[1]} layers, layers={self.layers}")

    @classmethod
    def of(cls, x: BackboneFeatures | torch.Tensor) -> BackboneFeatures:
        """Accept plain pooled rows [N, H] wherever features are expected."""
        return x if isinstance(x, BackboneFeatures) else cls(pooled=torch.as_tensor(x))

    def __len__(self) -> int:
        return int(self.pooled.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.pooled.shape[-1])

    def __getitem__(self, rows: int | slice | Sequence[int] | torch.Tensor) -> BackboneFeatures:
        """Rows of a batch (always kept 2-D), with the all-padding leading columns trimmed."""
        if isinstance(rows, int):
            rows = [rows]
        idx = rows if isinstance(rows, slice) else torch.as_tensor(rows, dtype=torch.long,
                                                                    device=self.pooled.device)
        if self.tokens is None:
            return BackboneFeatures(self.pooled[idx])
        tokens, mask = self.tokens[idx], self.mask[idx]  # type: ignore[index]
        if mask.shape[0] > 0:
            real = mask.any(0)
            start = int(real.int().argmax()) if bool(real.any()) else mask.shape[1]
            tokens, mask = tokens[:, :, start:], mask[:, start:]
        return BackboneFeatures(self.pooled[idx], tokens, mask, self.layers)

    def with_layers(self, layers: Sequence[int]) -> BackboneFeatures:
        """Only the given hidden-state layers (a subset of ``self.layers``); () drops the tokens."""
        layers = tuple(layers)
        if not layers:
            return BackboneFeatures(self.pooled)
        if self.tokens is None:
            raise ValueError(f"layers {layers} requested but these features carry no prefix tokens")
        missing = [i for i in layers if i not in self.layers]
        if missing:
            raise ValueError(f"layers {missing} were not computed (have {self.layers})")
        if layers == self.layers:
            return self
        pick = [self.layers.index(i) for i in layers]
        return BackboneFeatures(self.pooled, self.tokens[:, pick], self.mask, layers)

    def layer(self, index: int) -> torch.Tensor:
        """Hidden states [N, T, H] of one computed layer."""
        if self.tokens is None or index not in self.layers:
            raise ValueError(f"layer {index} not in these features (have {self.layers})")
        return self.tokens[:, self.layers.index(index)]

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> BackboneFeatures:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype) if dtype is not None else t.to(device)

        if self.tokens is None:
            return BackboneFeatures(move(self.pooled))
        return BackboneFeatures(move(self.pooled), move(self.tokens), self.mask.to(device),  # type: ignore[union-attr]
                                self.layers)

    @staticmethod
    def cat(parts: Sequence[BackboneFeatures]) -> BackboneFeatures:
        """Concatenate batches (same layers), left-padding token sequences to the longest."""
        if not parts:
            raise ValueError("nothing to concatenate")
        layers = parts[0].layers
        if any(p.layers != layers for p in parts):
            raise ValueError("cannot concatenate features with different layers")
        pooled = torch.cat([p.pooled for p in parts])
        if not layers:
            return BackboneFeatures(pooled)
        width = max(p.tokens.shape[2] for p in parts)  # type: ignore[union-attr]
        tokens, masks = [], []
        for p in parts:
            n, n_layers, t, h = p.tokens.shape  # type: ignore[union-attr]
            pad = width - t
            tokens.append(torch.cat([p.tokens.new_zeros(n, n_layers, pad, h), p.tokens], 2))  # type: ignore[union-attr]
            masks.append(torch.cat([p.mask.new_zeros(n, pad), p.mask], 1))  # type: ignore[union-attr]
        return BackboneFeatures(pooled, torch.cat(tokens), torch.cat(masks), layers)


class DeferredFeatures(ABC):
    """Features that depend on the policy reading them (a LoRA tenant's: its adapter is inside the
    backbone), computed when the policy consumes them — with autograd when grad mode is on.

    Indexing selects rows without computing anything, so a PPO minibatch of a LoRA tenant runs a
    fresh backbone forward through the adapter's current weights.
    """

    @abstractmethod
    def compute(self, policy: Any) -> BackboneFeatures:
        """The features under ``policy``'s adapter (autograd follows ``torch.is_grad_enabled()``)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, rows: Any) -> DeferredFeatures: ...
