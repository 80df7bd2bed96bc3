"""Workloads as files: a TOML file under ``workloads/`` read once, at entry, into typed settings
(:class:`WorkloadFile`); a bad key or value is a :class:`~nexus.errors.SpecError` naming the file and the key.

A workload says which tenants run which jobs when, on which devices the shared server and the isolated baseline
run, and which mechanism settings both modes may try while they are tuned (``[tuning]``: the same candidates
and so the same number of tries for each mode; the calibration seed they are tried on is never one they are
scored on). :meth:`WorkloadFile.draw` turns it into one run's jobs for a seed (Poisson arrivals drawn from it).
"""

from __future__ import annotations

import random
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from nexus.emulator.settings import DeviceCounts, load_calibration
from nexus.errors import SpecError, describe_errors
from nexus.spec import JobSpec, TenantSpec

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "workloads"
_JOB = TypeAdapter(JobSpec)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobStream(_Strict):
    """One job, or a stream of like jobs, a tenant submits: ``once`` at ``at_s``; ``every`` ``count`` jobs
    ``every_s`` apart from ``at_s`` (a tenant submitting continuously); ``poisson`` ``count`` jobs from ``at_s``,
    exponential gaps of mean ``window_s / count`` drawn from the run's seed. Times are seconds at k = 1."""

    job: dict[str, Any] = Field(description="the job as submitted (nexus.spec JobSpec: kind rl | sft | eval)")
    arrivals: Literal["once", "every", "poisson"] = "once"
    at_s: float = Field(0.0, ge=0)
    count: int = Field(1, ge=1, le=1000)
    every_s: float = Field(0.0, ge=0)
    window_s: float = Field(0.0, ge=0)

    @field_validator("job")
    @classmethod
    def _job(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _JOB.validate_python(v).model_dump(exclude_unset=True) | {"kind": v.get("kind")}

    @model_validator(mode="after")
    def _arrivals(self) -> JobStream:
        if self.arrivals == "once" and self.count != 1:
            raise ValueError("arrivals = 'once' submits one job: count must be 1 (or use 'every' / 'poisson')")
        if self.arrivals == "every" and self.count > 1 and self.every_s <= 0:
            raise ValueError("arrivals = 'every' needs every_s > 0")
        if self.arrivals == "poisson" and self.window_s <= 0:
            raise ValueError("arrivals = 'poisson' needs window_s > 0")
        return self

    def times(self, rng: random.Random) -> list[float]:
        if self.arrivals == "once":
            return [self.at_s]
        if self.arrivals == "every":
            return [self.at_s + i * self.every_s for i in range(self.count)]
        t, out = self.at_s, []
        for _ in range(self.count):
            t += rng.expovariate(self.count / self.window_s)
            out.append(t)
        return out


class Tenant(_Strict):
    """A tenant: its spec (``nexus.spec.TenantSpec`` fields, name aside) and its jobs; ``copies`` > 1 makes
    that many like tenants (``<name>-<i>``)."""

    name: str = Field(min_length=1, max_length=40, pattern=r"^[a-z0-9][a-z0-9-]*$")
    spec: dict[str, Any]
    jobs: list[JobStream] = Field(min_length=1)
    copies: int = Field(1, ge=1, le=64)

    @field_validator("spec")
    @classmethod
    def _spec(cls, v: dict[str, Any]) -> dict[str, Any]:
        TenantSpec.model_validate({"name": "check", **v})  # a bad field now, named
        return v


class Mechanisms(_Strict):
    """The mechanisms a tenant alone could use as much as a shared server: each a setting of the emulated
    devices or of the scheduler, applied the same way in both modes."""

    producers_per_sim: int = Field(1, ge=1, le=8, description="rollout producers per simulator device")
    rollout_split: int = Field(1, ge=1, le=16, description="an RL batch split over up to this many producers")
    lend_actor: bool = Field(False, description="actor devices step simulators between updates")
    lend_inference: bool = Field(False, description="engines' devices step simulators between forwards")
    infer_max_batch: int = Field(8, ge=1, le=256, description="group batching: rows one forward may take")
    max_inflight: int = Field(2, ge=1, le=8, description="pipelining: training items a tenant has admitted at once")

    def off(self) -> dict[str, Any]:
        """Each mechanism's value when it is off."""
        return {"producers_per_sim": 1, "rollout_split": 1, "lend_actor": False, "lend_inference": False,
                "infer_max_batch": 1, "max_inflight": 1}

    def toggled(self, name: str) -> tuple[Mechanisms, Mechanisms]:
        """(this with ``name`` off, this with ``name`` on): ``on`` is this setting when it is on here, else the
        setting's value in ``on_values``."""
        on_values = {"producers_per_sim": 2, "rollout_split": 4, "lend_actor": True, "lend_inference": True,
                     "infer_max_batch": 8, "max_inflight": 2}
        cur = getattr(self, name)
        on = self if cur != self.off()[name] else self.model_copy(update={name: on_values[name]})
        return self.model_copy(update={name: self.off()[name]}), on

    def label(self) -> str:
        return (f"m{self.producers_per_sim}-split{self.rollout_split}-lend{'A' if self.lend_actor else ''}"
                f"{'I' if self.lend_inference else ''}-batch{self.infer_max_batch}-inflight{self.max_inflight}")


class Tuning(_Strict):
    """Both modes try the same ``candidates`` on ``calibration_seed`` and keep their best (fewest device-seconds),
    frozen before ``score_seeds`` run; the calibration seed is not among them."""

    calibration_seed: int = Field(ge=0)
    score_seeds: list[int] = Field(min_length=1)
    candidates: list[Mechanisms] = Field(min_length=1)

    @model_validator(mode="after")
    def _apart(self) -> Tuning:
        if self.calibration_seed in self.score_seeds:
            raise ValueError(f"calibration_seed {self.calibration_seed} is also a score seed: nothing is tuned on "
                             "what it is scored on")
        return self


class Mode(_Strict):
    devices: str
    policy: str = Field(description="the catalog scheduler the mode's mechanisms are set on")
    actor_group: int = Field(0, ge=0, description="devices one update runs on (0: all actor devices)")
    settings: dict[str, Any] = Field(default_factory=dict, description="more scheduler settings, by name")

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: str) -> str:
        return DeviceCounts.parse(v).label()


class WorkloadFile(_Strict):
    name: str
    description: str = Field(min_length=1)
    calibration: str = Field(description="calibrations/ name the devices take their times from")
    envs_per_producer: int = Field(8, ge=1)
    shared: Mode
    isolated: Mode
    tenants: list[Tenant] = Field(min_length=1)
    tuning: Tuning

    @field_validator("calibration")
    @classmethod
    def _calibration(cls, v: str) -> str:
        load_calibration(v)  # a missing or bad calibration now, not at a run's boot
        return v

    @model_validator(mode="after")
    def _names(self) -> WorkloadFile:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names repeat: {names}")
        return self

    def draw(self, seed: int) -> list[dict[str, Any]]:
        """One run's jobs for ``seed``, in the file's order: ``tenant``, ``spec`` (seeded), ``job``, ``arrival_s``."""
        rng = random.Random(seed)
        out = []
        for t in self.tenants:
            for c in range(t.copies):
                name = t.name if t.copies == 1 else f"{t.name}-{c}"
                for s in t.jobs:
                    out += [{"tenant": name, "spec": {**t.spec, "seed": seed}, "job": dict(s.job), "arrival_s": at}
                            for at in s.times(rng)]
        return out


def load(path: str | Path) -> WorkloadFile:
    """The workload in ``path`` (or ``workloads/<name>.toml``); a bad file is a :class:`SpecError` naming the key."""
    p = Path(path)
    if not p.exists() and (WORKLOADS / f"{path}.toml").exists():
        p = WORKLOADS / f"{path}.toml"
    try:
        raw = tomllib.loads(p.read_text())
    except OSError as e:
        raise SpecError(f"workload {path}: cannot read it ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"workload {p}: not valid TOML ({e})") from None
    try:
        return WorkloadFile.model_validate(raw)
    except ValidationError as e:
        raise SpecError(f"workload {p}: {describe_errors(e.errors(), root='?', field_words=True)}") from None
