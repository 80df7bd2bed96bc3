"""Emulated devices: the real control plane at a scale this machine does not have.

The emulator is a tool apart from the service (``nexus.emulator``: it depends on ``nexus``, nothing in ``nexus``
imports it). In an emulated service (:func:`nexus.emulator.service.local`, ``python -m nexus.emulator up --emulate
CALIBRATION``) the three kinds of device work — an actor update, an inference forward, a simulator step — take the
time a **calibration** says instead of computing anything. It plugs into the service through its one seam, a model
of the workers' devices (:mod:`nexus.wire.devices`), which every worker installs from its preload
(:mod:`nexus.emulator.worker`) with these settings (``emulator.json`` in the service root, never in
``ServiceConfig``); everything around the device work is the real code: the
scheduler plugin, the training queue with its in-flight caps and staleness drops, the inference queue
with its group-batching rule, the Dask task graph, the engine pool and routing, weight-sync messages,
health. Devices are slots with counts (``devices``: actor-inference-simulator, e.g. 2-2-4): one worker
per service holds that many device lanes (a Dask resource count and as many threads), and every span a
lane records is charged to its own slot (``<worker>#<lane>``).

A calibration is a TOML file with its ``source`` (``calibrations/``, or a path):

* ``[forward.<family>]`` one grouped backbone forward: ``call_s + row_s * rows + tenant_s * tenants``
  (the fixed cost ``call_s`` is what group batching saves; ``experiments/group_batching`` measures it);
* ``[update.<kind>]`` one actor update on one device: ``call_s + row_s * rows * epochs``; a data-parallel
  group of ``g`` devices is ``g * dp_efficiency ** log2(g)`` times faster;
* ``[env."<catalog env>"]`` one lockstep step of a producer's K envs: ``step_s + env_s * K``; one action
  request covers ``chunk`` steps (a chunked VLA policy), resets cost ``reset_s``;
* ``sync_s``: pushing one tenant's head to the engines.

``producers_per_sim`` m lets a simulator device run m producers at once (the SIM resource and threads are
devices x m): a device steps one producer's envs at a time, the others queue for it, so what sharing buys
is the device time a lone producer leaves idle while it waits for actions. ``sim_placement`` says which device a
producer takes: the one with the fewest producers (``"fewest"``), or the one whose producers step the least of
their time (``"load"``: each producer's share is its calibrated chunk of steps over that chunk and one forward).

``lend_actor`` lets the actor's devices step simulators while no update runs on them (a device that changes role
when the actor starves): the actor rank lends them to the simulator workers when an update ends and takes them back
when the next arrives (:mod:`nexus.emulator.lent`). ``lend_inference`` lets the engines' devices step
simulators between forwards, time-sliced with them (``lend_contention``, below).

**Physical device models** (each charges what the hardware it stands for charges; docs/operator/emulation.md):

* *Where physics runs.* An env's steps run on a GPU simulator device (ManiSkill's GPU-parallel PhysX) or on host
  cores (``EnvCost.physics = "cpu"``: robosuite and LIBERO are CPU MuJoCo, always). A CPU-physics producer's steps
  take ``min(K, cores)`` of the simulator worker's host cores (``cores_per_sim_device`` per simulator device) for
  their calibrated time, never a GPU lane, and are never placed on a lent GPU: lending a GPU to them gains nothing.
* *Sharing a lent GPU.* Two processes on one GPU without MPS are time-sliced (NVIDIA's MPS guide: without MPS
  "their scheduling resources must be swapped on and off the GPU"; kernels of different processes do not run at
  once): while an engine's forward and a simulator's steps share a lent device, both progress ``lend_contention``
  times slower (default 2: an even time-slice). A forward does not go ahead of the steps for free.
* *Moving simulator state.* A piece of a producer's work run on a device other than the one holding its envs' state
  first moves that state: ``state_bytes`` per env over ``link_gb_s`` (PCIe Gen5 x16 by default), or, when the
  calibration gives no state size, a reset (the envs are rebuilt there). Coming back costs the same.

``time_scale`` k divides every service time, so long workloads run in minutes; the benchmark checks that
its figures do not move with k. Plain data, no torch, no I/O at import.
"""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nexus.errors import SpecError, describe_errors

# simulators whose physics is CPU MuJoCo (robosuite and LIBERO, which is built on robosuite): their steps run on
# host cores, whatever GPU the producer holds (MuJoCo's physics has no GPU path in these packages; MJX is a
# different simulator)
CPU_PHYSICS = ("robosuite", "libero")
# host cores per GPU on the paper's kind of server: a DGX H100 has 2 x 56-core Xeon Platinum 8480C for 8 GPUs
# (NVIDIA DGX H100 datasheet) -> 14 per GPU
CORES_PER_GPU = 14
# without MPS, processes sharing a GPU are time-sliced (NVIDIA Multi-Process Service guide, "When to use MPS":
# without it "their scheduling resources must be swapped on and off the GPU"; kernels of two processes never run at
# once): two busy processes each progress at about half speed, plus the context switches (not counted)
TIME_SLICED_CONTENTION = 2.0
# PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b -> ~63 GB/s each way (PCI-SIG PCIe 5.0 spec; NVIDIA H100 PCIe
# datasheet "PCIe Gen5: 128 GB/s", both ways); an HGX H100's NVLink 4 gives 450 GB/s each way (900 GB/s total)
PCIE5_X16_GB_S = 63.0

FILE = "emulator.json"  # the settings in an emulated service's root
ENV = "NEXUS_EMULATOR"  # ... and the variable that tells its workers' preload where they are


class DeviceCounts(BaseModel):
    """Devices per service: the paper's server is 2-2-4 (actor, inference, simulators)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    actor: int = Field(1, ge=1)
    inference: int = Field(1, ge=1)
    simulator: int = Field(2, ge=1)

    @classmethod
    def parse(cls, text: str) -> DeviceCounts:
        """``"2-2-4"`` -> actor 2, inference 2, simulator 4."""
        parts = text.split("-")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SpecError(f"devices {text!r}: expected actor-inference-simulator counts, e.g. 2-2-4")
        return cls(actor=int(parts[0]), inference=int(parts[1]), simulator=int(parts[2]))

    def label(self) -> str:
        return f"{self.actor}-{self.inference}-{self.simulator}"

    @property
    def total(self) -> int:
        return self.actor + self.inference + self.simulator


class ForwardCost(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    call_s: float = Field(ge=0, description="fixed cost of one forward call (what grouping saves)")
    row_s: float = Field(ge=0, description="cost per row (observation) in the call")
    tenant_s: float = Field(0.0, ge=0, description="per tenant head run on the call's features")


class UpdateCost(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    call_s: float = Field(ge=0, description="fixed cost of one update on one device")
    row_s: float = Field(ge=0, description="per row and epoch (RL: env steps of the batch; SFT: samples)")


class EnvCost(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    step_s: float = Field(ge=0, description="one lockstep step of a producer's envs, fixed part")
    env_s: float = Field(0.0, ge=0, description="... plus this per env stepped")
    reset_s: float = Field(0.0, ge=0, description="one episode reset")
    chunk: int = Field(1, ge=1, description="env steps per action request (a chunked policy)")
    episode_steps: int | None = Field(None, ge=1, description="steps per episode (default: the catalog's cap)")
    success: float = Field(0.5, ge=0, le=1, description="chance an emulated episode succeeds")
    physics: Literal["gpu", "cpu"] | None = Field(None, description="where its steps run: a GPU simulator device or "
                                                  "host cores (default: cpu for robosuite and LIBERO, CPU MuJoCo; "
                                                  "gpu for the others)")
    state_bytes: int | None = Field(None, ge=0, description="bytes of one env's state a move to another device "
                                    "copies (not given: a move rebuilds the envs there, a reset)")


class HostCost(BaseModel):
    """CPU seconds the real processes spend on the host per unit of work besides the device work (spent with
    ``device_work = "host_cpu"``, charged to no device; :mod:`nexus.emulator.host`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    engine_request_s: float = Field(0.0, ge=0, description="an engine's handling of one action request")
    sim_request_s: float = Field(0.0, ge=0, description="a producer's handling of one request (observations, reply)")
    actor_item_s: float = Field(0.0, ge=0, description="an actor rank's handling of one training item")


class Calibration(BaseModel):
    """Service times of one kind of hardware, with where they come from (``source``: required)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = ""
    source: str = Field(min_length=1, description="where the figures come from (a results file, a paper table)")
    description: str = ""
    forward: dict[str, ForwardCost]
    update: dict[str, UpdateCost]
    env: dict[str, EnvCost]
    dp_efficiency: float = Field(0.7, gt=0, le=1, description="data-parallel efficiency per doubling of devices")
    sync_s: float = Field(0.0, ge=0, description="one weight push of a tenant's head")
    host: HostCost = HostCost()
    notes: dict[str, str | float | int] = Field(default_factory=dict, description="derivation, free form")

    @model_validator(mode="after")
    def _kinds(self) -> Calibration:
        missing = {"rl", "sft"} - set(self.update)
        if missing:
            raise ValueError(f"update costs for {sorted(missing)} are missing")
        if "default" not in self.forward:
            raise ValueError("forward needs a 'default' family")
        for name, c in self.env.items():
            if c.physics == "gpu" and simulator_of(name) in CPU_PHYSICS:
                raise ValueError(f"env {name!r}: physics 'gpu', but {simulator_of(name)} is CPU MuJoCo: its steps "
                                 "run on host cores")
        return self


class EmulationSettings(BaseModel):
    """The emulator's settings (its own file, ``emulator.json`` in the service root): which calibration, how fast,
    how many devices."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    calibration: str = Field(description="a calibrations/ catalog name or a path to a calibration .toml")
    time_scale: float = Field(1.0, gt=0, le=1000, description="k: every service time is divided by k")
    devices: DeviceCounts = DeviceCounts()
    actor_group: int = Field(0, ge=0, description="devices one update runs on, data-parallel (0: all actor "
                             "devices; with fewer, devices.actor / actor_group updates may run at once)")
    producers_per_sim: int = Field(1, ge=1, le=8, description="rollout producers one simulator device runs at "
                                   "once; their steps take turns on it (a GPU simulator steps one producer's envs "
                                   "while another's wait for actions)")
    sim_placement: Literal["fewest", "load"] = Field(
        "fewest", description="the simulator device a producer takes: the one with the fewest producers, or the one "
        "whose producers step the least of their time (their calibrated share summed): a device whose producers "
        "step most of the time is left to producers that mostly wait for actions")
    lend_actor: bool = Field(False, description="the actor rank lends its devices to the simulator workers between "
                             "updates: a producer whose own device is busy runs its next reset or action chunk on an "
                             "idle actor device; the next update takes its devices back, cutting a chunk there at "
                             "its next step, and starts when that step ends")
    lend_inference: bool = Field(False, description="each engine lends its device to the simulator workers for good: "
                                 "a producer whose own device is busy runs its next reset or action chunk there when "
                                 "it is expected to end sooner, at the share of the device the engine leaves; a "
                                 "forward and the steps running with it share the device (lend_contention)")
    lend_contention: float = Field(TIME_SLICED_CONTENTION, ge=1.0, le=10.0, description="how many times slower a "
                                   "forward and a simulator's steps progress while they share a lent GPU (2: the "
                                   "even time-slice of two processes without MPS; 1 would be free overlap, which no "
                                   "measurement here supports)")
    cores_per_sim_device: int = Field(CORES_PER_GPU, ge=1, le=1024, description="host cores per simulator device "
                                      "that CPU-physics producers (robosuite, LIBERO) step on (DGX H100: 112 cores "
                                      "for 8 GPUs)")
    link_gb_s: float = Field(PCIE5_X16_GB_S, gt=0, description="GB/s one way between two devices, for moving a "
                             "producer's simulator state (PCIe Gen5 x16; 450 on an HGX H100's NVLink)")
    device_work: Literal["sleep", "host_cpu"] = Field(
        "sleep", description="how device work takes its time: 'sleep' (devices apart from the host); 'host_cpu' (a "
        "calibration of this host's own CPU cores: the work spends its seconds as CPU time on them, so services "
        "sharing the cores slow each other as the real ones do; time scale 1, no lending; nexus.emulator.host)")
    seed: int = Field(0, ge=0, description="emulated episode outcomes")
    table: Calibration | None = Field(None, description="the loaded calibration (filled in; workers never "
                                      "re-read the file)")

    @model_validator(mode="after")
    def _load(self) -> EmulationSettings:
        if self.actor_group > self.devices.actor or (self.actor_group and self.devices.actor % self.actor_group):
            raise ValueError(f"actor_group {self.actor_group} must divide devices.actor {self.devices.actor}")
        if self.device_work == "host_cpu" and (self.time_scale != 1 or self.lend_actor or self.lend_inference):
            raise ValueError("device_work 'host_cpu' spends CPU seconds on this host's cores: time_scale 1 and no "
                             "lending (lend_actor, lend_inference off)")
        if self.table is None:
            object.__setattr__(self, "table", load_calibration(self.calibration))
        return self

    @property
    def group(self) -> int:
        return self.actor_group or self.devices.actor

    @property
    def sim_places(self) -> int:
        """The simulator worker's ``SIM`` resource: a place per producer (devices x producers per device)."""
        return self.devices.simulator * self.producers_per_sim

    def sim_devices(self, places: int) -> int:
        """The simulator devices behind a worker's ``SIM`` places."""
        return max(1, places // self.producers_per_sim)

    def host_cores(self, places: int) -> int:
        """The host cores behind a simulator worker's ``SIM`` places, for its CPU-physics producers."""
        return self.sim_devices(places) * self.cores_per_sim_device

    def times(self) -> ServiceTimes:
        assert self.table is not None
        return ServiceTimes(self.table, self.time_scale, self.link_gb_s)

    def save(self, path: Path) -> None:
        """Written whole, the loaded calibration with it (workers never re-read the calibration file)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json(indent=1))
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> EmulationSettings:
        try:
            return cls.model_validate_json(Path(path).read_text())
        except OSError as e:
            raise SpecError(f"emulator settings {path}: cannot read them ({e.strerror or e})") from None
        except ValidationError as e:
            raise SpecError(f"emulator settings {path}: {describe_errors(e.errors(), root='?', field_words=True)}") \
                from None


class ServiceTimes:
    """Calibrated durations, already divided by the time scale k."""

    def __init__(self, cal: Calibration, time_scale: float = 1.0, link_gb_s: float = PCIE5_X16_GB_S) -> None:
        self.cal, self.k, self.link_gb_s = cal, float(time_scale), link_gb_s

    def forward_s(self, rows_by_family: dict[str, int], tenants: int) -> float:
        """One grouped forward: the largest fixed cost of its families, every row at its family's rate."""
        costs = {f: self.cal.forward.get(f, self.cal.forward["default"]) for f in rows_by_family}
        call = max(c.call_s for c in costs.values())
        rows = sum(costs[f].row_s * n for f, n in rows_by_family.items())
        head = max(c.tenant_s for c in costs.values()) * tenants
        return (call + rows + head) / self.k

    def update_s(self, kind: str, rows: int, epochs: int = 1, devices: int = 1) -> float:
        c = self.cal.update.get(kind, self.cal.update["sft"])
        speedup = devices * self.cal.dp_efficiency ** math.log2(devices) if devices > 1 else 1.0
        return (c.call_s + c.row_s * rows * max(epochs, 1)) / speedup / self.k

    def family(self, env: str, action_head: str) -> str:
        """The forward cost a tenant's rows take: its env's when the calibration has one (a camera env), else its
        action head family's (``forward_s`` falls back to ``default`` for one it does not have)."""
        return env if env in self.cal.forward else action_head

    def stepping_share(self, env: str, envs: int, family: str) -> float:
        """The share of its device's time a lone producer of ``envs`` envs spends stepping: a chunk of steps over
        that chunk and the forward that answers it (resets and the host's time left out)."""
        chunk = self.step_s(env, envs) * self.env(env).chunk
        total = chunk + self.forward_s({family: envs}, tenants=1)
        return chunk / total if total > 0 else 0.0

    def env(self, name: str) -> EnvCost:
        c = self.cal.env.get(name) or self.cal.env.get("default")
        if c is None:
            raise SpecError(f"calibration {self.cal.name!r} has no cost for env {name!r} (and no 'default')")
        return c

    def step_s(self, name: str, envs: int) -> float:
        c = self.env(name)
        return (c.step_s + c.env_s * envs) / self.k

    def reset_s(self, name: str) -> float:
        return self.env(name).reset_s / self.k

    def sync_s(self) -> float:
        return self.cal.sync_s / self.k

    def physics(self, name: str, simulator: str | None = None) -> str:
        """Where env ``name``'s steps run: ``"cpu"`` (host cores) or ``"gpu"`` (a simulator device). ``simulator``:
        the catalog's (else read from the env's name)."""
        sim = simulator or simulator_of(name)
        if sim in CPU_PHYSICS:
            return "cpu"
        return self.env(name).physics or "gpu"

    def move_s(self, name: str, envs: int) -> float:
        """Moving a producer's ``envs`` envs' state to another device: their bytes over the link, or a reset when
        the calibration does not give their size (the envs rebuilt there)."""
        c = self.env(name)
        if c.state_bytes is None:
            return c.reset_s / self.k
        return c.state_bytes * envs / (self.link_gb_s * 1e9) / self.k


def simulator_of(env: str) -> str:
    """The simulator an env name's suite names (``"robosuite/lift-state"`` -> ``"robosuite"``; LIBERO's suites are
    ``libero_*``)."""
    suite = env.split("/", 1)[0].lower()
    return "libero" if suite.startswith("libero") else suite


def catalog_dir() -> Path:
    """``calibrations/`` next to ``schedulers/`` (``NEXUS_CATALOG_ROOT`` moves both)."""
    return Path(os.environ.get("NEXUS_CATALOG_ROOT", Path(__file__).resolve().parents[2])) / "calibrations"


def load_calibration(ref: str) -> Calibration:
    """A catalog name (``"paper_gpu"`` -> ``calibrations/paper_gpu.toml``) or a path; errors name the file."""
    path = Path(ref).expanduser() if ref.endswith(".toml") or os.sep in ref else catalog_dir() / f"{ref}.toml"
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        names = sorted(p.stem for p in catalog_dir().glob("*.toml"))
        raise SpecError(f"calibration {ref!r}: cannot read {path} ({e.strerror or e}); calibrations/ has: "
                        f"{', '.join(names) or 'none'}") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"calibration file {path}: not valid TOML ({e})") from None
    try:
        return Calibration.model_validate({**raw, "name": raw.get("name", path.stem)})
    except ValidationError as e:
        raise SpecError(f"calibration file {path}: {describe_errors(e.errors(), root='?', field_words=True)}") from None
