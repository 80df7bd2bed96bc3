"""Flow matching for action chunks (rectified flow), shared by the GR00T- and π-style experts.

Convention: flow time ``tau`` runs from 0 (pure noise) to 1 (data); ``x_tau = tau * A + (1 - tau) * eps``
and the expert regresses the constant velocity ``A - eps``. This is GR00T N1's convention; π0 writes
the same flow with ``t = 1 - tau`` (t = 1 is noise) and the velocity ``eps - A``, so nothing but the
sign convention differs. Both papers sample training times from a Beta(1.5, 1) distribution that
puts more weight on the noisy end, and integrate with a few Euler steps at inference (GR00T: 4,
π0: 10).

Randomness comes from an explicit ``torch.Generator`` when given: the same generator seed gives the
same noise and times whatever else runs in the process (grouped and serial training stay identical).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlowConfig:
    steps: int = 10  # Euler steps at inference
    time_alpha: float = 1.5  # training times: 1 - tau ~ Beta(time_alpha, 1) (both papers)
    time_max: float = 0.999  # tau never reaches 1 exactly (no zero-noise training samples)


def sample_tau(n: int, cfg: FlowConfig, generator: torch.Generator | None = None,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Training flow times [n] in [0, time_max], denser near the noise end (tau = 0).

    Beta(alpha, 1) is sampled by inverse CDF (U ** (1 / alpha)) so an explicit generator can drive it.
    """
    u = torch.rand(n, generator=generator)
    beta = u.pow(1.0 / cfg.time_alpha)
    return (cfg.time_max * (1.0 - beta)).to(device)


def noise_like(actions: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard normal noise with ``actions``' shape, drawn on CPU (device-independent streams)."""
    return torch.randn(actions.shape, generator=generator).to(actions.device, actions.dtype)


def interpolate(actions: torch.Tensor, noise: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (x_tau, target velocity) for action chunks [N, chunk, A] and times [N]."""
    t = tau.to(actions.dtype).view(-1, *([1] * (actions.dim() - 1)))
    return t * actions + (1.0 - t) * noise, actions - noise


Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def integrate(velocity: Velocity, x0: torch.Tensor, steps: int,
              clamp: Callable[[torch.Tensor, float], torch.Tensor] | None = None) -> torch.Tensor:
    """Euler integration of dx/dtau = velocity(x, tau) from tau = 0 (``x0``, noise) to tau = 1. ``clamp(x, tau)``:
    applied after every step (and at tau = 0): inpainting puts known positions back on their path."""
    x = x0 if clamp is None else clamp(x0, 0.0)
    dt = 1.0 / steps
    for i in range(steps):
        tau = torch.full((x.shape[0],), i * dt, device=x.device, dtype=x.dtype)
        x = x + dt * velocity(x, tau)
        if clamp is not None:
            x = clamp(x, (i + 1) * dt)
    return x
