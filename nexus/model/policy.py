"""A tenant's trainable policy: one action module of a family (+ a value head for RL) on the shared backbone.

Families (``TenantSpec.action_head``):

| family | module | reads from the backbone | SFT loss | deterministic action |
|---|---|---|---|---|
| ``oft`` | :class:`OFTActionHead` | pooled feature | MSE of the Gaussian mean | the mean |
| ``groot`` | :class:`GR00TActionHead` | last-layer prefix tokens | flow matching | the flow from zero |
| ``pi`` | :class:`PiActionExpert` | last ``depth`` layers of prefix tokens | flow matching | the flow from zero |

Every family is a Gaussian policy around its deterministic action (RL: PPO, GRPO), with a learned state-independent std
(``head.log_std``, from ``init_log_std``) and a critic. For the flow families this is Flow-Noise (πRL) with the
noise on one denoising step: the Euler chain starts at zero noise, its steps are deterministic but the last, which
is Gaussian, so the sampled action's log-likelihood is exact — ``log N(a; flow(s), std²)`` — and needs no stored
denoising chain. Exported policies and evaluations take the deterministic action.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from nexus.features import TenantSchema
from nexus.model.backbone_features import BackboneFeatures, DeferredFeatures
from nexus.model.flow_matching import FlowConfig, integrate
from nexus.model.groot_head import GR00TActionHead
from nexus.model.layers import mlp, mlp_plain
from nexus.model.lora import TenantAdapter
from nexus.model.oft_head import OFTActionHead
from nexus.model.pi_head import PiActionExpert
from nexus.model.proprio_norm import build_proprio_norm
from nexus.spec import TenantSpec

FAMILIES = ("oft", "groot", "pi")
GAUSSIAN_FAMILIES = ("oft",)  # the head's output is the Gaussian mean (the others integrate a flow to it)
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))  # as torch.distributions.Normal.log_prob has it


def gaussian_logprob(action: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """log N(action; mean, scale) summed over the last dim: the Normal's own arithmetic, without building a
    torch.distributions object per call (its argument checks cost more than a head's matmuls for a row or two)."""
    return (-((action - mean) ** 2) / (2 * scale**2) - scale.log() - _LOG_SQRT_2PI).sum(-1)


@dataclass(frozen=True)
class ActionHeadConfig:
    """Every hyper-parameter of a tenant's action module, per family defaults from the papers."""

    family: str = "oft"
    hidden_dim: int = 256  # width of the head / expert
    chunk: int = 1  # actions predicted per observation
    init_log_std: float = -0.5  # initial Gaussian std (log) of the sampled actions
    proprio_norm: str = "tanh"  # how the state is scaled before the head reads it (nexus.model.proprio_norm)
    heads: int = 4  # groot / pi: attention heads
    depth: int | None = None  # groot: DiT blocks (4); pi: expert layers = backbone layers attended (2)
    flow_steps: int | None = None  # Euler steps at inference: groot 4 (GR00T N1), pi 10 (π0)
    time_alpha: float = 1.5  # flow times: 1 - tau ~ Beta(1.5, 1) in both papers

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown action head family {self.family!r} (one of {FAMILIES})")
        if self.chunk < 1:
            raise ValueError("chunk must be >= 1")

    @classmethod
    def from_spec(cls, spec: TenantSpec, chunk: int | None = None) -> ActionHeadConfig:
        return cls(family=spec.action_head, hidden_dim=spec.hidden_dim,
                   chunk=chunk if chunk is not None else spec.chunk, init_log_std=spec.init_log_std,
                   proprio_norm=spec.proprio_norm)

    @property
    def resolved_depth(self) -> int:
        return self.depth if self.depth is not None else {"groot": 4, "pi": 2}.get(self.family, 0)

    @property
    def flow(self) -> FlowConfig:
        steps = self.flow_steps if self.flow_steps is not None else {"groot": 4, "pi": 10}.get(self.family, 10)
        return FlowConfig(steps=steps, time_alpha=self.time_alpha)


def build_action_head(cfg: ActionHeadConfig, feat_dim: int, schema: TenantSchema) -> nn.Module:
    p, a, w = schema.proprio_dim, schema.action_dim, cfg.hidden_dim
    if cfg.family == "oft":
        return OFTActionHead(feat_dim, p, a, w, cfg.chunk, cfg.init_log_std)
    if cfg.family == "groot":
        return GR00TActionHead(feat_dim, p, a, w, cfg.chunk, depth=cfg.resolved_depth, heads=cfg.heads,
                               init_log_std=cfg.init_log_std)
    return PiActionExpert(feat_dim, p, a, w, cfg.chunk, depth=cfg.resolved_depth, heads=cfg.heads,
                          init_log_std=cfg.init_log_std)


class ValueHead(nn.Module):
    """MLP(pooled feature ⊕ proprio, as the policy normalized it) -> scalar state value."""

    def __init__(self, feat_dim: int, proprio_dim: int, hidden_dim: int = 256) -> None:
        super().__init__()
        self.net = mlp(feat_dim + proprio_dim, hidden_dim, 1, out_std=0.01)

    def forward(self, feat: torch.Tensor | BackboneFeatures, proprio: torch.Tensor,
                plain: bool = False) -> torch.Tensor:
        pooled = feat.pooled if isinstance(feat, BackboneFeatures) else feat
        x = torch.cat([pooled, proprio], dim=-1)
        return (mlp_plain(self.net, x) if plain else self.net(x)).squeeze(-1)


class TenantPolicy(nn.Module):
    """Everything a tenant trains: its action module (``head``), a critic (``value``, for PPO), and
    optionally a LoRA adapter on the shared backbone (``lora``, applied inside the backbone's forward).

    ``feat`` arguments accept :class:`BackboneFeatures` (with the prefix layers this policy asks for in
    :attr:`prefix_layers`), :class:`DeferredFeatures` (computed under this policy's adapter) or, for the
    OFT family, plain pooled rows [N, H].
    """

    def __init__(self, head: nn.Module, value: ValueHead | None, cfg: ActionHeadConfig,
                 lora: TenantAdapter | None = None, proprio_dim: int = 0) -> None:
        super().__init__()
        self.head = head
        self.value = value
        self.cfg = cfg
        self.lora = lora
        # the state as the head and critic read it; "running" statistics are buffers (they sync with the weights)
        self.proprio_norm = build_proprio_norm(cfg.proprio_norm, proprio_dim)
        if not self.gaussian:
            self._register_load_state_dict_pre_hook(self._fill_rl_parameters)

    def _fill_rl_parameters(self, state: dict, prefix: str, *args: object) -> None:
        """A flow policy's weights saved before flow families trained by RL lack the noise std and the critic:
        those keep their initial values (SFT never trained them)."""
        if prefix + "head.log_std" in state:
            return
        for name, tensor in self.state_dict().items():
            if name == "head.log_std" or name.startswith("value."):
                state.setdefault(prefix + name, tensor)

    @classmethod
    def from_spec(cls, spec: TenantSpec, schema: TenantSchema, feat_dim: int, chunk: int | None = None,
                  cfg: ActionHeadConfig | None = None,
                  lora_shapes: dict[str, tuple[int, int]] | None = None) -> TenantPolicy:
        """Deterministic init from ``spec.seed`` (the caller's global RNG stream is left untouched).

        A spec with ``lora`` needs ``lora_shapes`` (``SharedBackbone.lora_shapes(spec.lora)``)."""
        if spec.action_dim is not None and spec.action_dim != schema.action_dim:
            raise ValueError(f"tenant {spec.name!r}: spec action_dim={spec.action_dim} but the schema has "
                             f"action_dim={schema.action_dim}")
        cfg = cfg or ActionHeadConfig.from_spec(spec, chunk)
        if chunk is not None and cfg.chunk != chunk:
            cfg = replace(cfg, chunk=chunk)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            head = build_action_head(cfg, feat_dim, schema)
            value = ValueHead(feat_dim, schema.proprio_dim, cfg.hidden_dim)
            lora = None
            if spec.lora is not None:  # built last: heads of tenants with and without LoRA init the same
                if not lora_shapes:
                    raise ValueError(f"tenant {spec.name!r} has a LoRA adapter: its backbone projection shapes "
                                     "(lora_shapes) are needed to build it")
                lora = TenantAdapter(spec.lora, lora_shapes)
        return cls(head, value, cfg, lora, schema.proprio_dim)

    @classmethod
    def from_bytes(cls, data: bytes, spec: TenantSpec, schema: TenantSchema, feat_dim: int, chunk: int | None = None,
                   lora_shapes: dict[str, tuple[int, int]] | None = None) -> TenantPolicy:
        """A policy (CPU, eval mode) from exported weights (``torch.save`` bytes of its ``state_dict``, as
        ``TenantSlot.export_weights`` writes them), e.g. on an inference worker."""
        policy = cls.from_spec(spec, schema, feat_dim, chunk=chunk, lora_shapes=lora_shapes)
        policy.load_state_dict(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
        return policy.eval()

    # -- what the policy is ------------------------------------------------------------------------

    @property
    def family(self) -> str:
        return self.cfg.family

    @property
    def gaussian(self) -> bool:
        """The head outputs the Gaussian mean (SFT regresses it), or integrates a flow to it (flow matching)."""
        return self.cfg.family in GAUSSIAN_FAMILIES

    @property
    def prefix_layers(self) -> tuple[int, ...]:
        """Backbone hidden-state layers this policy reads besides the pooled feature."""
        return tuple(self.head.prefix_layers)

    @property
    def chunk(self) -> int:
        return self.head.chunk

    @property
    def action_dim(self) -> int:
        return self.head.action_dim

    @property
    def action_size(self) -> int:
        """Flat action size A = chunk * action_dim."""
        return self.head.chunk * self.head.action_dim

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def _inputs(self, feat: BackboneFeatures | DeferredFeatures | torch.Tensor | np.ndarray,
                proprio: torch.Tensor | np.ndarray) -> tuple[BackboneFeatures, torch.Tensor]:
        p = next(self.parameters())
        if isinstance(feat, DeferredFeatures):
            feat = feat.compute(self)
        feats = BackboneFeatures.of(feat if isinstance(feat, BackboneFeatures) else torch.as_tensor(feat))
        if self.prefix_layers:  # fails clearly when the prefix tokens this family reads are missing
            feats = feats.with_layers(self.prefix_layers)
        return feats.to(p.device, p.dtype), self.proprio_norm.normalize(torch.as_tensor(proprio).to(p.device, p.dtype))

    # -- actions -----------------------------------------------------------------------------------

    def mean_action(self, feat: BackboneFeatures | torch.Tensor, proprio: torch.Tensor) -> torch.Tensor:
        """The deterministic action [N, A]: Gaussian mean, or the flow integrated from zero noise."""
        return self._mean(*self._inputs(feat, proprio))

    def velocity(self, feat: BackboneFeatures, proprio: torch.Tensor, x: torch.Tensor,
                 tau: torch.Tensor) -> torch.Tensor:
        """Flow families: velocity [N, chunk, action_dim] at noisy chunks ``x`` and flow times ``tau``."""
        if self.gaussian:
            raise TypeError(f"the {self.family!r} family is a Gaussian policy, not a flow")
        feats, proprio = self._inputs(feat, proprio)
        return self.head.velocity(feats, proprio, x, tau)

    def _mean(self, feats: BackboneFeatures, proprio: torch.Tensor, plain: bool = False,
              prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The Gaussian's mean [N, A]: the OFT head's output, or the flow's Euler chain from zero noise (every
        step deterministic; the sampled action is this plus the last step's Gaussian noise). ``prefix`` (flow
        families): (actions [N, chunk, A], mask [N, chunk, 1], 1 where the robot executed the action): real-time
        chunking by inpainting — after every step the masked positions are put back on their path from the
        start (zero) noise to the executed action (``tau * prefix``), so the velocity of the other positions is
        computed with the prefix in the chunk's attention, and the chunk ends on the prefix exactly (the
        replacement form of the RTC paper's inpainting, without its guidance term)."""
        if self.gaussian:
            return self.head(feats, proprio, plain=plain)
        p = next(self.parameters())
        x0 = torch.zeros(len(feats), self.chunk, self.action_dim, device=p.device, dtype=p.dtype)
        clamp = None
        if prefix is not None:
            target, mask = (t.to(p.device, p.dtype) for t in prefix)

            def clamp(x: torch.Tensor, tau: float) -> torch.Tensor:
                return torch.where(mask > 0, tau * target, x)
        x = integrate(lambda x, tau: self.head.velocity(feats, proprio, x, tau), x0, self.cfg.flow.steps, clamp)
        return x.flatten(1)

    @torch.no_grad()
    def act(self, feat: BackboneFeatures | torch.Tensor, proprio: torch.Tensor, deterministic: bool = False,
            generator: torch.Generator | None = None, noise: torch.Tensor | None = None, plain: bool = False,
            prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample (or take the deterministic action) -> (unclipped action [N, A], logprob [N], value [N]).

        ``noise``: the standard-normal draws [N, chunk * A] (each row's own; else from ``generator``). ``plain``:
        an OFT head's layers as functional ops (the same numbers, a fraction of the calls' cost for a row or two),
        for a policy that is a plain module (an inference engine's, an exported one), never a ZeRO-3 one.
        ``prefix``: a flow family's executed prefix (see :meth:`_mean`); a Gaussian head decodes its chunk's
        positions in parallel, independently, so it has nothing to condition (the engine puts the prefix in front).
        """
        feats, proprio = self._inputs(feat, proprio)
        mean = self._mean(feats, proprio, plain=plain, prefix=prefix)  # log-probs: the same numbers as evaluate()'s
        scale = self.head.log_std.exp().expand_as(mean)
        if deterministic:
            action = mean
        else:
            if noise is None:
                noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            action = mean + scale * noise.to(mean.device, mean.dtype).reshape(mean.shape)
            if prefix is not None and not self.gaussian:  # executed actions happened: no noise on them
                executed = prefix[1].to(mean.device).expand(-1, -1, self.action_dim).flatten(1) > 0
                action = torch.where(executed, mean, action)
        value = self.value(feats, proprio, plain=plain)  # type: ignore[misc]
        return action, gaussian_logprob(action, mean, scale), value

    def evaluate(self, feat: BackboneFeatures | torch.Tensor, proprio: torch.Tensor,
                 action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """With autograd: (logprob [N], entropy [N], value [N]) of given (unclipped) actions. A flow family's
        gradient runs back through its whole Euler chain."""
        feats, proprio = self._inputs(feat, proprio)
        mean = self._mean(feats, proprio)
        dist = torch.distributions.Normal(mean, self.head.log_std.exp().expand_as(mean))
        action = torch.as_tensor(action).to(mean.device, mean.dtype)
        return dist.log_prob(action).sum(-1), dist.entropy().sum(-1), self.value(feats, proprio)  # type: ignore[misc]
