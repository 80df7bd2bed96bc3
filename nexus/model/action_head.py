"""The action-module families on the shared backbone (index; each lives in its own module).

- OFT-style (``nexus.model.oft_head``): learned action queries, parallel decoding, Gaussian policy.
- GR00T-style (``nexus.model.groot_head``): flow-matching DiT conditioned on the backbone's tokens.
- π-style (``nexus.model.pi_head``): flow-matching expert attending layer-wise to the prefix + state.

``nexus.model.policy`` wraps one of them (plus a value head for RL families) as a ``TenantPolicy``.
"""

from nexus.model.groot_head import GR00TActionHead
from nexus.model.layers import PROPRIO_SCALE, normalize_proprio
from nexus.model.oft_head import OFTActionHead
from nexus.model.pi_head import PiActionExpert
from nexus.model.policy import (
    FAMILIES,
    GAUSSIAN_FAMILIES,
    ActionHeadConfig,
    TenantPolicy,
    ValueHead,
    build_action_head,
)

__all__ = ["FAMILIES", "GAUSSIAN_FAMILIES", "PROPRIO_SCALE", "ActionHeadConfig", "GR00TActionHead",
           "OFTActionHead", "PiActionExpert", "TenantPolicy", "ValueHead", "build_action_head",
           "normalize_proprio"]
