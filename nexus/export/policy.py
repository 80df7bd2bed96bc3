"""A tenant's policy as a self-contained directory: written by ``nexus export``, run without a service.

Layout (format ``joynexus-policy``, version 1)::

    manifest.json         tenant, version, spec, schema, backbone reference, sha256 of every other file
    backbone.json         the backbone it ran on: family, offline preset or checkpoint path, image size,
                          dtype, sha256 of its weights, the model's Hugging Face config
    head.safetensors      action module (+ value head) weights
    adapter/              LoRA tenants only, in peft's format (loads with ``peft.PeftModel.from_pretrained``
                          onto the backbone): adapter_config.json, adapter_model.safetensors
    preprocessor.json     the tenant preprocessor: schema (cameras in order, proprio dim, instruction),
                          image size, prompt format
    normalization.json    observation / action transforms and the training data's action statistics
    README.md             how to load it

``load(DIR)`` rebuilds the backbone from its reference (an offline preset is rebuilt bit-identically
from its seed; a checkpoint loads with ``from_pretrained`` from its path, or from ``backbone_path``
where it moved), checks the weights' sha256, and returns an :class:`ExportedPolicy` whose
``predict_action`` gives the service's action for the same observation. ``initial_state`` turns a
directory into the initial weights of a new tenant (``TenantSpec(init_from=DIR)``).

Reading a directory's manifest needs neither torch nor the model: ``nexus.export.files`` (what a client
checks after a download).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nexus.errors import Conflict, NotFound, SpecError
from nexus.export.files import (
    ADAPTER,
    ADAPTER_WEIGHTS,
    BACKBONE,
    FORMAT,
    FORMAT_VERSION,
    HEAD,
    MANIFEST,
    NORMALIZATION,
    PREPROCESSOR,
    README,
    is_policy_dir,
    read_manifest,
    sha256_file,
    write_json,
)
from nexus.features import Observation, TenantSchema
from nexus.model.backbone import BackboneConfig, SharedBackbone
from nexus.model.framework import VLAFramework
from nexus.model.layers import PROPRIO_SCALE
from nexus.model.lora import TenantAdapter
from nexus.model.policy import TenantPolicy
from nexus.model.preprocessor import TenantPreprocessor
from nexus.model.proprio_norm import CLIP, MIN_VAR
from nexus.spec import TenantSpec
from nexus.wire.inputs import check_observation, nested_observation

__all__ = ["MANIFEST", "ExportedPolicy", "initial_state", "is_policy_dir", "load", "read_manifest", "write"]


# -- writing ------------------------------------------------------------------------------------------

def backbone_reference(backbone: SharedBackbone) -> dict[str, Any]:
    """What names a backbone exactly: how to rebuild it and the sha256 of its weights."""
    cfg = backbone.cfg
    return {"family": cfg.family, "source": "checkpoint" if cfg.local_path else "offline-preset",
            "size": None if cfg.local_path else cfg.size, "local_path": cfg.local_path,
            "image_size": cfg.image_size, "dtype": cfg.dtype, "model_key": cfg.model_key(),
            "weights_sha256": backbone.fingerprint(), "model_class": type(backbone.model).__name__,
            "hf_config": backbone.model.config.to_dict()}


def proprio_normalization(spec: TenantSpec, state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
    """How the head reads the state (``TenantSpec.proprio_norm``), with a running normalization's statistics."""
    if spec.proprio_norm == "tanh":
        return {"transform": "tanh", "scale": PROPRIO_SCALE,
                "formula": "head input = tanh(state / scale), a fixed squashing without statistics"}
    var = state_dict["proprio_norm.var"].double()
    return {"transform": "running", "clip": CLIP, "min_var": MIN_VAR,
            "count": int(state_dict["proprio_norm.count"]), "mean": state_dict["proprio_norm.mean"].tolist(),
            "var": var.tolist(), "formula": "head input = clip((state - mean) / sqrt(var + min_var), -clip, clip), "
                                            "statistics of the states of the tenant's RL batches"}


def normalization(proprio: dict[str, Any], action_stats: dict[str, Any] | None) -> dict[str, Any]:
    return {"proprio": proprio,
            "images": {"resize": "bilinear to image_size x image_size (RGB uint8)"},
            "action": {"transform": "identity",
                       "note": "actions are in the environment's own action space, unclipped; the service "
                               "clips them to the environment's action bounds before stepping"},
            "action_stats": action_stats}


def action_statistics(actions: Any, source: str) -> dict[str, Any] | None:
    """Per-dimension mean / std / min / max of the actions a policy was trained on (None: none)."""
    import numpy as np

    a = np.asarray(actions, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] == 0:
        return None
    return {"source": source, "rows": int(a.shape[0]), "mean": a.mean(0).tolist(), "std": a.std(0).tolist(),
            "min": a.min(0).tolist(), "max": a.max(0).tolist()}


def write(path: str | Path, *, spec: TenantSpec, schema: TenantSchema, version: int,
          state_dict: dict[str, torch.Tensor], backbone: SharedBackbone, action_stats: dict[str, Any] | None = None,
          source: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write a policy directory at ``path`` (atomically: a temporary sibling renamed at the end).

    ``state_dict`` is the tenant policy's (head, value head, ``lora.*`` adapter). An existing non-empty
    ``path`` is refused (:class:`Conflict`) and left as it is.
    """

    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise Conflict(f"export target {str(path)!r} exists and is not an empty directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    try:
        head = {k: v.detach().cpu().contiguous() for k, v in state_dict.items() if not k.startswith("lora.")}
        meta = {"format": "pt", "tenant": spec.name, "version": str(version)}
        save_file(head, str(tmp / HEAD), metadata=meta)
        if spec.lora is not None:
            _write_adapter(tmp / ADAPTER, spec, state_dict, backbone, meta)
        ref = backbone_reference(backbone)
        write_json(tmp / BACKBONE, ref)
        write_json(tmp / PREPROCESSOR, {
            "schema": asdict(schema), "camera_order": [c.name for c in schema.cameras],
            "image_size": backbone.cfg.image_size, "prompt_format": backbone.cfg.family,
            "compat_key": backbone.cfg.compat_key()})
        write_json(tmp / NORMALIZATION, normalization(proprio_normalization(spec, state_dict), action_stats))
        (tmp / README).write_text(_readme(spec, version, ref))
        files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "tenant": spec.name, "version": version,
                    "created": time.time(), "spec": spec.model_dump(mode="json"), "schema": asdict(schema),
                    "action_head": spec.action_head, "chunk": spec.chunk, "action_dim": schema.action_dim,
                    "lora": spec.lora.model_dump(mode="json") if spec.lora else None,
                    "backbone": {k: ref[k] for k in ("family", "source", "size", "local_path", "image_size", "dtype",
                                                     "weights_sha256")},
                    "source": source or {}, "files": files}
        write_json(tmp / MANIFEST, manifest)
        if path.exists():
            path.rmdir()  # empty (checked above)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write_adapter(folder: Path, spec: TenantSpec, state_dict: dict[str, torch.Tensor], backbone: SharedBackbone,
                   meta: dict[str, str]) -> None:

    adapter = _adapter_from_state(spec, state_dict, backbone)
    folder.mkdir()
    cfg = adapter.peft_config(base_model_class=type(backbone.model).__name__)
    cfg.base_model_name_or_path = backbone.cfg.local_path
    cfg.save_pretrained(str(folder))
    save_file(adapter.peft_state_dict(), str(folder / ADAPTER_WEIGHTS), metadata=meta)


def _adapter_from_state(spec: TenantSpec, state_dict: dict[str, torch.Tensor], backbone: SharedBackbone):

    adapter = TenantAdapter(spec.lora, backbone.lora_shapes(spec.lora))  # type: ignore[arg-type]
    sub = {k[len("lora."):]: v for k, v in state_dict.items() if k.startswith("lora.")}
    adapter.load_state_dict(sub)
    return adapter


def _readme(spec: TenantSpec, version: int, ref: dict[str, Any]) -> str:
    where = ref["local_path"] or f"the offline {ref['family']} preset {ref['size']!r} (rebuilt from its seed)"
    return (f"# JoyNexus policy: tenant `{spec.name}`, version {version}\n\n"
            f"Action module `{spec.action_head}` (chunk {spec.chunk})"
            + (f", LoRA rank {spec.lora.rank} on {', '.join(spec.lora.target_modules)}" if spec.lora else "")
            + f", on the {ref['family']} backbone at {where} (weights sha256 `{ref['weights_sha256'][:16]}…`).\n\n"
            "```python\nimport nexus.export.policy\npolicy = nexus.export.policy.load(DIR)   # backbone_path=... "
            "if the checkpoint moved\nout = policy.predict_action({'state': state, 'images': {...}})\n```\n\n"
            "`adapter/` (LoRA tenants) is a peft adapter for the backbone; `head.safetensors` the action "
            "module; `manifest.json` lists every file with its sha256.\n")


# -- reading ------------------------------------------------------------------------------------------

def _spec_schema(m: dict[str, Any]) -> tuple[TenantSpec, TenantSchema]:
    return TenantSpec.model_validate(m["spec"]), TenantSchema.from_dict(m["schema"])


def _check_backbone(path: Path, ref: dict[str, Any], backbone: SharedBackbone) -> None:
    got = backbone.fingerprint()
    if got != ref["weights_sha256"]:
        raise SpecError(f"exported policy {str(path)!r} ran on backbone weights sha256 "
                        f"{ref['weights_sha256'][:16]}…, but {backbone.cfg.model_key()!r} has {got[:16]}…: "
                        "its head would read different features")


def _load_weights(path: Path, m: dict[str, Any], policy: TenantPolicy) -> None:
    """Head (+ adapter) weights of a policy directory into ``policy`` (built from the same spec)."""

    head = load_file(str(path / HEAD))
    own = {k: v for k, v in policy.state_dict().items() if not k.startswith("lora.")}
    if set(head) != set(own) or any(head[k].shape != own[k].shape for k in own):
        raise SpecError(f"exported policy {str(path)!r}: head weights do not fit a {policy.family!r} head of "
                        f"this spec (hidden_dim, chunk, schema dims, family or proprio_norm differ)")
    policy.load_state_dict(head, strict=False)
    if m.get("lora"):
        if policy.lora is None:
            raise SpecError(f"exported policy {str(path)!r} carries a LoRA adapter (its head reads adapted "
                            "features) but the tenant spec has no lora")
        exported, own = TenantSpec.model_validate(m["spec"]).lora, policy.lora.cfg
        key = (exported.rank, exported.alpha, set(exported.target_modules))  # type: ignore[union-attr]
        if key != (own.rank, own.alpha, set(own.target_modules)):
            raise SpecError(f"exported policy {str(path)!r}: its adapter (rank {key[0]}, alpha {key[1]}, "
                            f"{sorted(key[2])}) does not fit the spec's lora (rank {own.rank}, alpha {own.alpha}, "
                            f"{sorted(own.target_modules)})")
        policy.lora.load_peft_state_dict(load_file(str(path / ADAPTER / ADAPTER_WEIGHTS)))


def initial_state(path: str | Path, spec: TenantSpec, schema: TenantSchema,
                  backbone: SharedBackbone) -> dict[str, torch.Tensor]:
    """A new tenant's initial policy state_dict from an exported policy (``TenantSpec(init_from=...)``).

    The exported policy must have run on these exact backbone weights and its head must fit the spec
    (family, hidden_dim, chunk, proprio and action dims). A LoRA spec takes the exported adapter when
    there is one (same rank and targets), else starts its adapter fresh (a no-op at first) on the
    exported head. Raises :class:`SpecError` / :class:`NotFound` and changes nothing otherwise.
    """

    path = Path(path)
    m = read_manifest(path)
    _check_backbone(path, m["backbone"], backbone)
    _, exported_schema = _spec_schema(m)
    if (exported_schema.proprio_dim, exported_schema.action_dim) != (schema.proprio_dim, schema.action_dim):
        raise SpecError(f"exported policy {str(path)!r} has proprio/action dims ({exported_schema.proprio_dim}, "
                        f"{exported_schema.action_dim}), tenant {spec.name!r} needs "
                        f"({schema.proprio_dim}, {schema.action_dim})")
    if m["action_head"] != spec.action_head:
        raise SpecError(f"exported policy {str(path)!r} has a {m['action_head']!r} action head, tenant "
                        f"{spec.name!r} asks for {spec.action_head!r}")
    policy = TenantPolicy.from_spec(spec, schema, backbone.hidden_size, lora_shapes=backbone.lora_shapes(spec.lora))
    _load_weights(path, m, policy)
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


class ExportedPolicy:
    """An exported policy running on its own copy of the backbone, without a service."""

    def __init__(self, path: Path, manifest: dict[str, Any], framework: VLAFramework, policy: TenantPolicy,
                 spec: TenantSpec, schema: TenantSchema) -> None:
        self.path, self.manifest, self.framework, self.policy = path, manifest, framework, policy
        self.spec, self.schema = spec, schema

    @property
    def tenant(self) -> str:
        return self.spec.name

    @property
    def version(self) -> int:
        return int(self.manifest["version"])

    @property
    def backbone(self) -> SharedBackbone:
        return self.framework.backbone

    def predict_action(self, obs: Observation | dict[str, Any], deterministic: bool = True) -> dict[str, Any]:
        """The action for one observation, as the service's inference engine answers it: ``action`` (the
        first action of the chunk, unclipped), ``logprob``, ``value``, ``version`` and, for chunked
        policies, ``chunk`` (the whole flat chunk)."""
        return self.predict_actions([obs], deterministic)[0]

    def predict_actions(self, observations: list[Observation | dict[str, Any]],
                        deterministic: bool = True) -> list[dict[str, Any]]:
        """Actions for a batch of observations (one backbone forward)."""
        import numpy as np
        import torch

        # a dict is checked as the service's predict checks it (the one observation layout, the same errors)
        obs = [o if isinstance(o, Observation) else check_observation(o, self.schema, field=f"observations[{i}]")
               for i, o in enumerate(observations)]
        feats = [self.framework.preprocess(self.tenant, o) for o in obs]
        (idx, cond), = self.framework.group_features([(self.tenant, f) for f in feats]).values()
        proprio = torch.as_tensor(np.stack([feats[i].proprio for i in idx]))
        with torch.no_grad():
            action, logprob, value = self.policy.act(cond, proprio, deterministic=deterministic)
        action = action.float().cpu().numpy()
        outs: list[dict[str, Any]] = [{} for _ in obs]
        for j, i in enumerate(idx):
            out = {"action": action[j][:self.policy.action_dim], "logprob": float(logprob[j]),
                   "value": float(value[j]), "version": self.version}
            if self.policy.chunk > 1:
                out["chunk"] = action[j]
            outs[i] = out
        return outs

    def predict(self, observation: dict[str, Any], state: Any = None, episode_start: Any = None,
                deterministic: bool = True) -> tuple[Any, Any]:
        """Stable-Baselines3's ``predict(obs) -> (action, state)``: ``observation`` as a service env gives it
        (``nexus.client.envs``: ``state`` and ``images``, one observation or a batch; or SB3's flattened form,
        :func:`nexus.wire.inputs.flat_observation`); the actions are clipped to the service's action bounds [-1, 1].
        The policy keeps no recurrent state (``state`` passes through), so ``evaluate_policy(policy, env)``
        works on it."""
        import numpy as np

        observation = nested_observation(observation)
        states = np.asarray(observation["state"], np.float32)
        single = states.ndim == 1
        rows = states[None] if single else states
        cams = {c: np.asarray(v) for c, v in (observation.get("images") or {}).items()}
        obs = [Observation(state=rows[i], images={c: (v if single else v[i]) for c, v in cams.items()},
                           instruction=self.schema.instruction) for i in range(len(rows))]
        actions = np.clip(np.stack([o["action"] for o in self.predict_actions(obs, deterministic)]), -1.0, 1.0)
        return (actions[0] if single else actions), state


def load(path: str | Path, *, device: str = "cpu", backbone_path: str | None = None,
         verify: bool = True) -> ExportedPolicy:
    """Load an exported policy directory and its backbone (never from a model hub).

    ``backbone_path`` points at the backbone checkpoint where it lives now (a checkpoint-backed export);
    ``verify`` checks file hashes and the backbone weights' sha256 (refusing a mismatch).
    """
    import torch


    path = Path(path)
    m = read_manifest(path, verify_files=verify)
    ref = json.loads((path / BACKBONE).read_text())
    spec, schema = _spec_schema(m)
    local = backbone_path or ref["local_path"]
    if ref["source"] == "checkpoint" and not (local and os.path.isdir(local)):
        raise NotFound(f"exported policy {str(path)!r} runs on the backbone checkpoint {ref['local_path']!r}, "
                       "which is not a directory here: pass backbone_path=")
    cfg = BackboneConfig(family=ref["family"], size=ref["size"] or "tiny", local_path=local if ref["source"] ==
                         "checkpoint" else None, image_size=ref["image_size"], dtype=ref["dtype"], device=device)
    backbone = SharedBackbone(cfg)
    if verify:
        _check_backbone(path, ref, backbone)
    policy = TenantPolicy.from_spec(spec, schema, backbone.hidden_size, lora_shapes=backbone.lora_shapes(spec.lora))
    _load_weights(path, m, policy)
    policy = policy.to(device=torch.device(device))
    framework = VLAFramework(backbone)
    framework.add_tenant(spec.name, policy, TenantPreprocessor(schema, cfg))
    return ExportedPolicy(path, m, framework, policy, spec, schema)
