"""``python -m nexus.emulator up --emulate CALIBRATION [--time-scale K] [--devices A-I-S] [nexus up's options]``:
``nexus up`` on emulated devices (:mod:`nexus.emulator.service`); stop it with ``nexus down`` as any service."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nexus.client import cli
from nexus.emulator.service import EmulatedLocalService, settings_of
from nexus.emulator.settings import DeviceCounts


def _up(a: argparse.Namespace) -> int:
    emu = settings_of({"calibration": a.emulate, "time_scale": a.time_scale,
                       "devices": DeviceCounts.parse(a.devices).model_dump()})  # bad input: before anything starts

    def start(cfg: Any) -> cli.Nexus:
        return cli.Nexus.local(config=cfg, service=lambda c: EmulatedLocalService(c, emu))

    return cli._up(a, start=start)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nexus.emulator",
                                description="JoyNexus on emulated devices: the real service, calibrated device times")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start a long-running local service on emulated devices (`nexus down` stops it)")
    u.add_argument("--emulate", required=True, metavar="CALIBRATION",
                   help="updates, forwards and simulator steps take the calibrated times of CALIBRATION (a "
                        "calibrations/ name or a .toml path); the control plane is the real one")
    u.add_argument("--time-scale", type=float, default=1.0, metavar="K", help="every service time divided by K")
    u.add_argument("--devices", default="1-1-2", metavar="A-I-S",
                   help="actor, inference and simulator devices (the paper's server: 2-2-4)")
    cli.add_up_options(u)
    u.set_defaults(fn=_up)
    return p


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
