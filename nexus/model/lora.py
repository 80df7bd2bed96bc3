"""Tenant LoRA adapters on the shared backbone, applied per row of a grouped forward (S-LoRA / Punica style).

A tenant's :class:`TenantAdapter` holds one low-rank pair (A: in -> r, B: r -> out) per adapted projection
of the backbone's text decoder; it is a submodule of the tenant's ``TenantPolicy``, so its parameters
live in the tenant's own DeepSpeed engine (optimizer state included), travel with the head's weights
and never touch the backbone. The backbone's own weights stay frozen and are never copied.

:class:`AdapterRouter` puts forward hooks on the adapted projections of the one resident backbone. A
grouped forward names each row's adapter (or none); every adapted projection then computes the shared
base matmul once for the whole group and adds each adapter's low-rank product to its own rows only
(gather the rows, ``B(A(x)) * alpha / r``, scatter-add back). Rows without an adapter get exactly the
base output, so tenants without LoRA keep sharing the plain forward; adapters of any rank mix in one
forward. Unlike peft's ``adapter_names`` mixed batch (eval mode only), this works with autograd, so
one grouped forward can train many tenants' adapters at once; a row's gradient reaches only its own
adapter (attention mixes tokens within a row, never across rows).

Adapter files use peft's format (``adapter_config.json`` + ``adapter_model.safetensors`` with peft's
key names), so an exported adapter loads onto the same backbone with ``peft.PeftModel.from_pretrained``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nexus.spec import LoraConfig

# Both backbone families keep their text decoder at ``language_model.layers.N``; attention projections
# under ``self_attn``, MLP projections under ``mlp``.
_DECODER = r"language_model\.layers\.\d+"
_GROUP = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PEFT_PREFIX = "base_model.model."  # peft's key prefix for a PeftModel around the bare backbone


def target_regex(cfg: LoraConfig) -> str:
    """The module-path pattern of ``cfg``'s targets (peft's ``target_modules`` as a full-match regex)."""
    alts = "|".join(f"{_GROUP[t]}\\.{t}" for t in cfg.target_modules)
    return f"{_DECODER}\\.({alts})"


def lora_shapes(model: nn.Module, cfg: LoraConfig) -> dict[str, tuple[int, int]]:
    """``{module path: (in_features, out_features)}`` of the backbone projections ``cfg`` adapts."""
    pattern = re.compile(target_regex(cfg))
    shapes = {name: (int(m.in_features), int(m.out_features)) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and pattern.fullmatch(name)}
    if not shapes:
        raise ValueError(f"the backbone has no text-decoder projections named {list(cfg.target_modules)}")
    return shapes


def _key(module_name: str) -> str:
    return module_name.replace(".", "-")  # ModuleDict keys cannot contain dots


class LoraLayer(nn.Module):
    """One adapted projection: ``B(A(dropout(x))) * alpha / r``; A as nn.Linear's (and peft's) default init,
    B zero, so a fresh adapter changes nothing."""

    def __init__(self, in_features: int, out_features: int, cfg: LoraConfig) -> None:
        super().__init__()
        self.lora_A = nn.Linear(in_features, cfg.rank, bias=False)
        self.lora_B = nn.Linear(cfg.rank, out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.scaling = cfg.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lora_A.weight
        return self.lora_B(self.lora_A(self.dropout(x.to(device=w.device, dtype=w.dtype)))) * self.scaling


class TenantAdapter(nn.Module):
    """A tenant's LoRA adapter: one :class:`LoraLayer` per adapted backbone projection."""

    def __init__(self, cfg: LoraConfig, shapes: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        if not shapes:
            raise ValueError("an adapter needs at least one projection to adapt")
        self.cfg = cfg
        self.module_names = tuple(sorted(shapes))
        self.layers = nn.ModuleDict({_key(n): LoraLayer(*shapes[n], cfg) for n in self.module_names})

    def layer(self, module_name: str) -> LoraLayer | None:
        key = _key(module_name)
        return self.layers[key] if key in self.layers else None  # type: ignore[return-value]

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return {n: (self.layer(n).lora_A.in_features, self.layer(n).lora_B.out_features)  # type: ignore[union-attr]
                for n in self.module_names}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- peft's file format -------------------------------------------------------------------------

    def peft_config(self, base_model_class: str | None = None) -> Any:
        """The equivalent ``peft.LoraConfig`` (the exact module set as a full-match regex)."""
        import peft

        cfg = peft.LoraConfig(r=self.cfg.rank, lora_alpha=self.cfg.alpha, lora_dropout=self.cfg.dropout,
                              target_modules=target_regex(self.cfg), bias="none", inference_mode=True)
        if base_model_class:
            cfg.auto_mapping = {"base_model_class": base_model_class}
        return cfg

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under peft's saved key names (``base_model.model.<module>.lora_A.weight``)."""
        out: dict[str, torch.Tensor] = {}
        for n in self.module_names:
            lo = self.layer(n)
            out[f"{PEFT_PREFIX}{n}.lora_A.weight"] = lo.lora_A.weight.detach().cpu().contiguous()  # type: ignore[union-attr]
            out[f"{PEFT_PREFIX}{n}.lora_B.weight"] = lo.lora_B.weight.detach().cpu().contiguous()  # type: ignore[union-attr]
        return out

    def load_peft_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights saved by :meth:`peft_state_dict` (or by peft); the module set must match exactly."""
        want = set(self.peft_state_dict())
        if set(state) != want:
            missing, extra = sorted(want - set(state))[:3], sorted(set(state) - want)[:3]
            raise ValueError(f"adapter weights do not match this adapter's projections (missing {missing}, "
                             f"unexpected {extra})")
        with torch.no_grad():
            for n in self.module_names:
                lo = self.layer(n)
                for part in ("lora_A", "lora_B"):
                    dst = getattr(lo, part).weight
                    src = state[f"{PEFT_PREFIX}{n}.{part}.weight"]
                    if src.shape != dst.shape:
                        raise ValueError(f"adapter weight {n}.{part}: shape {tuple(src.shape)}, this adapter "
                                         f"has {tuple(dst.shape)} (rank {self.cfg.rank})")
                    dst.copy_(src)


class AdapterRouter:
    """Per-row LoRA on one backbone: forward hooks on its adapted projections (installed on first use).

    :meth:`route` names one adapter (or None) per batch row for the forwards run inside it. Outside a
    route, or for rows without an adapter, a projection's output is exactly its base output.
    Rows of one adapter should be contiguous (``SharedBackbone.encode_prefix`` sorts them so, as S-LoRA
    does): each adapter then reads a slice of the input (a view) and all deltas are added to the base
    output at once, so the cost stays linear in the rows whatever the number of adapters. Scattered rows
    fall back to a gather / scatter-add per adapter. Callers serialize forwards (the backbone's model
    lock); the route is per router, not per thread.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._modules = dict(model.named_modules())
        self._hooked: dict[str, Any] = {}
        self._segments: list[tuple[TenantAdapter | None, int, int]] | None = None  # contiguous runs
        self._scattered: list[tuple[TenantAdapter, torch.Tensor]] | None = None  # (adapter, row indices)
        self._install_lock = threading.Lock()

    @property
    def hooked(self) -> tuple[str, ...]:
        return tuple(sorted(self._hooked))

    def _ensure_hooks(self, names: Sequence[str]) -> None:
        missing = [n for n in names if n not in self._hooked]
        if not missing:
            return
        with self._install_lock:
            for name in missing:
                module = self._modules.get(name)
                if not isinstance(module, nn.Linear):
                    raise ValueError(f"adapter targets {name!r}, which is not a linear layer of this backbone")
                self._hooked[name] = module.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def add_adapters(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
            segments, scattered = self._segments, self._scattered
            if segments is None and scattered is None:
                return None
            x, out = args[0], output

            def delta(lo: LoraLayer, rows: torch.Tensor) -> torch.Tensor:
                return lo(rows).to(device=out.device, dtype=out.dtype)

            if segments is not None:
                parts: list[torch.Tensor] = []
                adapted = False
                for adapter, start, end in segments:
                    lo = adapter.layer(name) if adapter is not None else None
                    if lo is None:
                        parts.append(out.new_zeros((end - start, *out.shape[1:])))
                    else:
                        parts.append(delta(lo, x[start:end]))
                        adapted = True
                if not adapted:
                    return None
                return out + (parts[0] if len(parts) == 1 else torch.cat(parts))
            for adapter, rows in scattered or ():
                lo = adapter.layer(name)
                if lo is not None:
                    out = out.index_add(0, rows, delta(lo, x.index_select(0, rows)))
            return out

        return add_adapters

    @contextmanager
    def route(self, adapters: Sequence[TenantAdapter | None], device: torch.device | str) -> Iterator[None]:
        """Within the block, row ``i`` of each forward gets ``adapters[i]`` (None: the base model only)."""
        if all(a is None for a in adapters):
            yield
            return
        runs: list[tuple[TenantAdapter | None, int, int]] = []
        for i, a in enumerate(adapters):
            if runs and runs[-1][0] is a:
                runs[-1] = (a, runs[-1][1], i + 1)
            else:
                runs.append((a, i, i + 1))
        for a, _, _ in runs:
            if a is not None:
                self._ensure_hooks(a.module_names)
        if len({id(a) for a, _, _ in runs}) == len(runs):
            self._segments = runs
        else:
            groups: dict[int, tuple[TenantAdapter, list[int]]] = {}
            for i, a in enumerate(adapters):
                if a is not None:
                    groups.setdefault(id(a), (a, []))[1].append(i)
            self._scattered = [(a, torch.tensor(rows, dtype=torch.long, device=device)) for a, rows in groups.values()]
        try:
            yield
        finally:
            self._segments = self._scattered = None
