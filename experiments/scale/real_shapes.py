"""Backbones of real shape, counted on torch's meta device: how big they are, what one forward of a sample's
prefix costs, what one tenant with a LoRA r = 8 adapter adds to the actor, and how many tenants fit on one
80 GiB device beside the frozen backbone.

Presets: ``medium`` (the largest one the CPU tests run) and the architectures of Qwen3-VL-2B / 4B and
PaliGemma-3B (``nexus/model/qwen3vl.py``, ``paligemma.py``; random weights, never downloaded). Nothing is
allocated: every model and every tenant policy is built under ``torch.device("meta")``.

Per tenant (the service's own accounting, ``nexus.actor.slots.slot_bytes``): its trainable parameters (LoRA
adapter on the decoder's q/v projections, the OFT action head and the value head at the default width 256,
LIBERO's 8-D state and 7-D actions), each taking 28 bytes on the actor at its peak.

    python experiments/scale/real_shapes.py            # prints the table, writes results.json's real_shapes section
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nexus.actor.slots import ACTOR_BYTES_PER_PARAM, slot_bytes  # noqa: E402
from nexus.features import TenantSchema  # noqa: E402
from nexus.model.lora import lora_shapes  # noqa: E402
from nexus.model.policy import TenantPolicy  # noqa: E402
from nexus.model.shapes import count_backbone, meta_model  # noqa: E402
from nexus.spec import LoraConfig, TenantSpec  # noqa: E402

OUT = Path(__file__).with_name("results.json")  # its "real_shapes" section; bench.py keeps it
PRESETS = [("qwen3vl", "medium"), ("qwen3vl", "2b"), ("qwen3vl", "4b"), ("paligemma", "medium"),
           ("paligemma", "3b")]
DEVICE_BYTES = 80 * 2**30  # one 80 GiB accelerator (H100 / A100 80 GB)
SAMPLE = dict(n_images=2, image_size=224, text_tokens=16)  # two cameras at 224 px, a short instruction
SCHEMA = TenantSchema(8, 7)  # LIBERO's common recipe: 8-D state, 7-D actions
# the actor's bytes per trainable parameter at its peak (nexus/actor/slots.py: ACTOR_BYTES_PER_PARAM)
PER_PARAM = {"fp32 weights": 4, "gradients": 4, "AdamW moments (2)": 8, "ZeRO gradient buffers": 4,
             "weight export copies (transient)": 8}


def tenant(model: torch.nn.Module, hidden: int) -> dict:
    spec = TenantSpec(name="t", env="maniskill/pushcube-state", lora=LoraConfig(rank=8))
    shapes = lora_shapes(model, spec.lora)
    with torch.device("meta"):
        policy = TenantPolicy.from_spec(spec, SCHEMA, hidden, lora_shapes=shapes)
    parts = {"lora": 0, "head": 0, "value": 0}
    for name, p in policy.named_parameters():
        parts[name.split(".", 1)[0]] += p.numel()
    params = sum(parts.values())
    bytes_ = slot_bytes(spec, SCHEMA, hidden, shapes)
    assert bytes_ == ACTOR_BYTES_PER_PARAM * params == sum(PER_PARAM.values()) * params
    return {"params": parts, "params_total": params, "adapted_projections": len(shapes), "bytes": bytes_,
            "bytes_by_component": {k: v * params for k, v in PER_PARAM.items()}}


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for family, size in PRESETS:
        model = meta_model(family, size)
        assert all(p.is_meta for p in model.parameters())
        count = count_backbone(family, size, model=model, **SAMPLE)
        t = tenant(model, count.hidden)
        backbone = count.bytes(torch.bfloat16)
        rows.append({**count.as_dict(), "tenant": t,
                     "tenants_per_80GiB": (DEVICE_BYTES - backbone) // t["bytes"]})
    print(f"{'preset':<19}{'params':>8}{'vision':>8}{'bf16':>9}{'fp32':>9}{'GFLOP/sample':>14}"
          f"{'LoRA r=8':>10}{'head+value':>11}{'MiB/tenant':>11}{'tenants/80GiB':>14}")
    for r in rows:
        t = r["tenant"]
        print(f"{r['family'] + '/' + r['size']:<19}{r['params'] / 1e9:>7.3f}B{r['params_vision'] / 1e6:>7.0f}M"
              f"{r['bytes_bf16'] / 2**30:>7.2f}Gi{r['bytes_fp32'] / 2**30:>7.2f}Gi{r['flops'] / 1e9:>14.1f}"
              f"{t['params']['lora'] / 1e6:>9.3f}M{(t['params']['head'] + t['params']['value']) / 1e6:>10.3f}M"
              f"{t['bytes'] / 2**20:>11.1f}{r['tenants_per_80GiB']:>14,}")
    doc = json.loads(OUT.read_text()) if OUT.exists() else {}
    doc["real_shapes"] = {"sample": SAMPLE, "schema": [SCHEMA.proprio_dim, SCHEMA.action_dim],
                          "device_bytes": DEVICE_BYTES, "bytes_per_trainable_param": PER_PARAM, "presets": rows}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
