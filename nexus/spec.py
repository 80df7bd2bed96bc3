"""Tenant and job specifications (pydantic). No torch: validated inside the scheduler process.

A spec is plain data; ``nexus.config.catalog`` checks it against the environment and dataset catalogs.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nexus.algorithms.grpo import GRPOConfig
from nexus.algorithms.ppo import PPOConfig
from nexus.errors import SpecError

__all__ = ["AdamParams", "GRPOConfig", "PPOConfig", "EvalJob", "ExternalEnv", "JobRequest", "JobSpec",
           "LoraConfig", "RLJob", "RewardTerm", "SFTJob", "TenantSpec"]

TenantName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,39}$")]

# A client connection's id (``Nexus.session``): it names the MLflow run of its low-level ops, lands in tags
# and run names, so a short token of safe characters; calls without one share the tenant's default session.
SESSION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
DEFAULT_SESSION = "default"
SESSION_HEADER = "X-Nexus-Session"  # how the HTTP transport sends it to the gateway


def check_session(session: str | None) -> str:
    """The session id of a low-level op (None: the tenant's default session); a bad one is a SpecError."""
    if session is None:
        return DEFAULT_SESSION
    if not isinstance(session, str) or not SESSION_PATTERN.fullmatch(session):
        raise SpecError(f"session id {str(session)[:80]!r}: 1 to 64 letters, digits, '-' or '_', starting with a "
                        "letter or digit")
    return session
# A saved training state's name (``save_state`` / ``load_state``): a folder name under the tenant's states/.
STATE_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
OPS = ("forward_backward", "forward", "optim_step", "save_weights", "save_state", "load_state")  # low-level verbs


def check_state_name(name: object) -> str:
    """A ``save_state`` / ``load_state`` name; a bad one is a SpecError."""
    if not isinstance(name, str) or not STATE_NAME_PATTERN.fullmatch(name) or ".." in name:
        raise SpecError(f"state name {str(name)[:80]!r}: 1 to 64 letters, digits, '.', '-' or '_', starting with a "
                        "letter or digit (no '..')")
    return name


class _Spec(BaseModel):
    # NaN / inf are refused in every float field (a NaN lr or init_log_std would poison a slot silently)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# The backbone's text-decoder projections (same names in Qwen3-VL and Gemma/PaliGemma) that may carry a
# tenant's LoRA adapter. Every decoder layer sees every prefix token (image tokens included), so these
# adapt the visual features the head reads; the vision towers themselves are not adapted (their rows
# are image patches, not samples).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Spec):
    """A tenant's low-rank adapter on the shared backbone (LoRA: W x + (alpha / rank) B A x)."""

    rank: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is scaled by alpha / rank")
    target_modules: tuple[str, ...] = Field(("q_proj", "v_proj"), min_length=1,
                                            description=f"text-decoder projections, any of {LORA_TARGETS}")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")

    @model_validator(mode="after")
    def _known_targets(self) -> LoraConfig:
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA target modules {unknown}: the backbone's adaptable projections are "
                             f"{list(LORA_TARGETS)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"LoRA target_modules repeat a name: {list(self.target_modules)}")
        return self

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class ExternalCamera(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,39}$")
    height: int = Field(ge=8, le=1024)
    width: int = Field(ge=8, le=1024)


class ExternalEnv(_Spec):
    """A tenant's own environment or robot (not one the service hosts): what its observations and actions
    look like. Its episodes reach RL jobs as uploads (``RLJob(rollouts="external")``)."""

    proprio_dim: int = Field(ge=1, le=4096, description="the observation's state vector")
    action_dim: int = Field(ge=1, le=256)
    cameras: tuple[ExternalCamera, ...] = Field((), max_length=8, description="uint8 RGB images per step")
    instruction: str = Field("", max_length=2000, description="the task in words (the backbone's prompt)")


# A reward term's name: a built-in ("success", "env_reward") or one the env's catalog entry declares
# ("tcp_to_obj_dist", "info.is_grasped"); checked against the entry at validation (nexus.config.validation).
REWARD_PREFIX = "reward/"  # a term's statistics and metrics: "reward/<term>", its mean sum per episode
REWARD_TERM_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}(\.[A-Za-z_][A-Za-z0-9_]{0,63})?$"


class RewardTerm(_Spec):
    """One term of a tenant's own reward for a service-hosted env: ``weight * transform(value)``, per step, where
    ``value`` is the named quantity the env exposes after the step (its catalog entry lists them). The terms
    are data, evaluated by the service's fixed code: no expression or code of the tenant runs."""

    term: str = Field(pattern=REWARD_TERM_PATTERN, max_length=129,
                      description="what the env exposes: success (0/1), env_reward (the env's own reward), or a "
                      "term of its catalog entry (distances, grasps/contacts, info.<key>)")
    weight: float = Field(1.0, ge=-1e3, le=1e3)
    transform: Literal["linear", "tanh", "exp", "below"] = Field(
        "linear", description="linear: x; tanh: 1 - tanh(scale * x); exp: exp(-scale * x); below: 1 if x < "
        "threshold else 0 (tanh and exp turn a distance into a closeness in (0, 1])")
    scale: float = Field(1.0, gt=0, le=1e4, description="tanh / exp: how fast the closeness falls with x")
    threshold: float | None = Field(None, description="below: the value under which the term is 1")

    @model_validator(mode="after")
    def _threshold_for_below(self) -> RewardTerm:
        if (self.transform == "below") != (self.threshold is not None):
            raise ValueError(f"reward term {self.term!r}: a threshold goes with transform='below' and only with it")
        return self


class TenantSpec(_Spec):
    """A tenant: its task (env for RL/eval, dataset for SFT), action module and limits."""

    name: TenantName
    env: str | None = Field(None, max_length=200, description="catalog env, e.g. 'maniskill/pushcube-state'")
    dataset: str | None = Field(None, max_length=200, description="catalog dataset, e.g. 'pickcube-scripted'")
    external: ExternalEnv | None = Field(None, description="instead of a catalog env: the schema of the "
                                         "tenant's own environment or robot, whose episodes it uploads")
    action_dim: int | None = Field(None, ge=1, description="checked against the env/dataset schema")
    action_head: Literal["oft", "groot", "pi"] = Field(
        "oft", description="action-module family: oft (Gaussian head), groot / pi (flow matching); all train by SFT "
        "and RL")
    chunk: int = Field(1, ge=1, le=64, description="actions predicted per observation (RL needs 1)")
    hidden_dim: int = Field(256, ge=8)
    init_log_std: float = -0.5
    proprio_norm: Literal["tanh", "running"] = Field(
        "tanh", description="how the head reads the state: tanh(x / 3) (fixed), or running: standardized by the "
        "running mean / variance of the states of the tenant's training batches, SFT and RL (CleanRL's "
        "observation normalization; low-level ops leave the statistics as they are)")
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0, description="max gradient norm of every optimizer step")
    priority: int = 0
    # None: the service decides (limits.default_max_inflight 2 and default_max_staleness 128 by default and in
    # every shipped scheduler, the values these fields had before)
    max_inflight: int | None = Field(None, ge=1, description="training items admitted at once (queued + running); "
                                     "unset: the service's limits.default_max_inflight")
    max_staleness: int | None = Field(None, ge=0, description="RL batches lagging more versions are dropped; "
                                      "unset: the service's limits.default_max_staleness")
    seed: int = Field(0, ge=0, description="simulator episode seeds derive from it (ServiceLimits.max_seed)")
    output_dir: str | None = Field(None, max_length=4096, description="default: <root>/tenants/<name>; elsewhere "
                                                                      "only inside the service's output_base")
    lora: LoraConfig | None = Field(None, description="a LoRA adapter on the shared backbone (off by default)")
    init_from: str | None = Field(None, max_length=4096, description="an exported policy directory to initialise "
                                  "the head (and adapter) from, when the tenant has no checkpoint yet")
    reward: tuple[RewardTerm, ...] | None = Field(
        None, min_length=1, max_length=16, description="the tenant's own reward in its catalog env: the sum of these "
        "weighted terms per step (RL and evaluation returns); unset: the env's own reward")

    @model_validator(mode="after")
    def _needs_a_source(self) -> TenantSpec:
        if self.env is None and self.dataset is None and self.external is None:
            raise ValueError("a tenant needs an 'env' (RL/eval), an 'external' env (RL on uploaded episodes) or a "
                             "'dataset' (SFT)")
        if self.env is not None and self.external is not None:
            raise ValueError("a tenant has a catalog 'env' or an 'external' one, not both")
        if self.reward is not None:
            if self.env is None:
                raise ValueError("a 'reward' needs a catalog 'env': its terms are what the service's simulator "
                                 "exposes (an external env's episodes carry the tenant's own rewards)")
            names = [t.term for t in self.reward]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"reward terms {twice} appear twice: one entry per term (each is logged by name)")
        return self

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TenantSpec:
        if self.action_head != "oft" and self.hidden_dim % 4:
            raise ValueError(f"hidden_dim={self.hidden_dim}: the {self.action_head!r} expert's 4 attention heads "
                             "need a multiple of 4")
        return self


class AdamParams(_Spec):
    """One ``optim_step``'s Adam settings (Tinker's ``AdamParams``); a field left unset keeps the tenant's own
    (``TenantSpec.lr``, ``weight_decay``; betas and eps AdamW's defaults 0.9, 0.999, 1e-8). They apply to that
    step only."""

    learning_rate: float | None = Field(None, gt=0, le=10)
    beta1: float | None = Field(None, ge=0, lt=1)
    beta2: float | None = Field(None, ge=0, lt=1)
    eps: float | None = Field(None, gt=0, le=1)
    weight_decay: float | None = Field(None, ge=0, le=10)


class SFTJob(_Spec):
    kind: Literal["sft"] = "sft"
    steps: int = Field(50, ge=1)
    batch_size: int = Field(32, ge=1)


class RLJob(_Spec):
    """Online RL in the tenant's env: ``algorithm`` "ppo" (GAE with the value head; settings in ``ppo``) or
    "grpo" (no critic: each batch is ``episodes_per_batch // grpo.group_size`` groups of episodes reset with
    one seed, scored within their group; settings in ``grpo``)."""

    kind: Literal["rl"] = "rl"
    algorithm: Literal["ppo", "grpo"] = "ppo"
    updates: int = Field(5, ge=1, description="policy versions to produce")
    episodes_per_batch: int = Field(2, ge=1)
    collectors: int = Field(2, ge=1, description="rollout tasks kept in flight")
    split: int = Field(1, ge=1, le=64, description="rollout tasks one batch's episodes are split over, run at once "
                       "(on as many simulator workers as are free) and trained on as one batch; whole groups each")
    ppo: PPOConfig = PPOConfig()
    rollouts: Literal["service", "external"] = Field(
        "service", description="service: rollouts in the service's simulators; external: the tenant uploads "
        "its own episodes (its env or robot, actions from predict), each upload one update's batch")
    grpo: GRPOConfig = GRPOConfig()

    @model_validator(mode="after")
    def _whole_groups(self) -> RLJob:
        if self.algorithm == "grpo" and self.rollouts == "external":
            raise ValueError("algorithm='grpo' needs groups of episodes reset with one seed by the service's "
                             "simulators; uploaded (external) episodes train with algorithm='ppo'")
        if self.algorithm == "grpo" and self.episodes_per_batch % self.grpo.group_size:
            raise ValueError(f"episodes_per_batch={self.episodes_per_batch} is not a multiple of "
                             f"grpo.group_size={self.grpo.group_size}: a GRPO batch is whole groups")
        return self

    @property
    def settings(self) -> PPOConfig | GRPOConfig:
        """The chosen algorithm's hyper-parameters."""
        return self.grpo if self.algorithm == "grpo" else self.ppo

    @property
    def update_epochs(self) -> int:
        return self.settings.update_epochs

    def lr_scale(self, index: int) -> float:
        """Update ``index``'s (0-based) share of the tenant's learning rate (the algorithm's ``anneal_lr``)."""
        return self.settings.lr_scale(index, self.updates)

    @property
    def group_size(self) -> int:
        """Episodes reset with one seed (1: every episode its own seed)."""
        return self.grpo.group_size if self.algorithm == "grpo" else 1


class EvalJob(_Spec):
    kind: Literal["eval"] = "eval"
    episodes: int = Field(4, ge=1)
    version: int | None = Field(None, ge=0, description="policy version to pin; default: current")
    deterministic: bool = True
    protocol: Literal["episodes", "suite"] = Field(
        "episodes", description="episodes: `episodes` seeded episodes in the tenant's env; suite: the standard "
        "protocol over the tasks of the env's suite (LIBERO): per task one episode from each of its first "
        "`initial_states` fixed initial states, the catalog's step limit, success per task and on average")
    tasks: list[int] | None = Field(None, max_length=200, description="suite: the task indices (default: all)")
    initial_states: int = Field(50, ge=1, le=50, description="suite: episodes per task (initial states 0..n-1; "
                                "LIBERO has 50 per task)")


JobSpec = Annotated[SFTJob | RLJob | EvalJob, Field(discriminator="kind")]


class JobRequest(_Spec):
    tenant: TenantName
    job: JobSpec
