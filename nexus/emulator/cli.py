"""``python -m nexus.emulator up --emulate CALIBRATION [--time-scale K] [--devices A-I-S] [--emulator-set KEY=VALUE]
[nexus up's options]``: ``nexus up`` on emulated devices (:mod:`nexus.emulator.service`); stop it with ``nexus down``
as any service. ``--emulator-set`` sets any other of the emulator's settings (``producers_per_sim=2``,
``lend_actor=true``, ...: :class:`~nexus.emulator.settings.EmulationSettings`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from nexus.client import cli
from nexus.emulator.service import EmulatedLocalService, settings_of
from nexus.emulator.settings import DeviceCounts
from nexus.errors import SpecError


def _value(text: str) -> Any:
    """``2`` -> 2, ``true`` -> True, ``load`` -> "load" (a JSON value, else the text)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _up(a: argparse.Namespace) -> int:
    more = {}
    for item in a.emulator_set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SpecError(f"--emulator-set {item!r}: expected KEY=VALUE, e.g. producers_per_sim=2")
        more[key.strip()] = _value(value.strip())
    emu = settings_of({**more, "calibration": a.emulate, "time_scale": a.time_scale,
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
    u.add_argument("--emulator-set", action="append", default=[], metavar="KEY=VALUE",
                   help="another of the emulator's settings, e.g. producers_per_sim=2, lend_actor=true")
    cli.add_up_options(u)
    u.set_defaults(fn=_up)
    return p


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
