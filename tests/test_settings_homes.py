"""One home per setting: every knob of the service is defined once, in the section of its concern.

``ServiceConfig`` is walked recursively (its sections are pydantic models); a setting's name defined by two
different models is a second home (the kind of duplication that ``SchedulerPolicy`` + ``POLICY_FIELDS`` once
kept in sync by hand), and so is a settings model beside the tree that repeats one of the tree's names. A
scheduler file sets exactly keys of ``ServiceConfig``, and every setting carries the description the
configuration reference is generated from."""

from __future__ import annotations

import inspect
import tomllib
import typing
from pathlib import Path

from pydantic import BaseModel

from nexus.config import scheduling
from nexus.config import service as config
from nexus.config.service import Scheduler, ServiceConfig

REPO = Path(__file__).resolve().parents[1]
# sections owned elsewhere whose fields' descriptions are not this walk's business (the emulated devices'
# calibration tables are described in their calibrations/*.toml files)
UNDESCRIBED_OK = ("emulation.",)
# the same name in two models that is not one setting twice: the emulated devices' calibration rows (a time per call
# and per row of a forward and of an update: two devices' costs of the same shape, not one knob)
ALLOWED_TWICE = {"call_s": {"ForwardCost", "UpdateCost"}, "row_s": {"ForwardCost", "UpdateCost"}}


def _models(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def settings(model: type[BaseModel] = ServiceConfig, prefix: str = "") -> list[tuple[str, type[BaseModel], str]]:
    """Every leaf setting under ``model``: (dotted path, the model that defines it, its name)."""
    out = []
    for name, f in model.model_fields.items():
        subs = _models(f.annotation)
        if subs:
            for sub in subs:
                out += settings(sub, f"{prefix}{name}.")
        else:
            out.append((prefix + name, model, name))
    return out


def sections(model: type[BaseModel] = ServiceConfig) -> set[type[BaseModel]]:
    found = {model}
    for f in model.model_fields.values():
        for sub in _models(f.annotation):
            found |= sections(sub)
    return found


def test_no_setting_is_defined_in_two_sections():
    defined: dict[str, set[type[BaseModel]]] = {}
    for _, model, name in settings():
        defined.setdefault(name, set()).add(model)
    twice = {name: sorted(m.__name__ for m in models) for name, models in defined.items()
             if len(models) > 1 and {m.__name__ for m in models} != ALLOWED_TWICE.get(name)}
    assert not twice, f"settings defined in two sections (rename one, or give it one home): {twice}"


def test_no_settings_model_beside_the_tree_repeats_a_setting():
    """A model in the settings modules that is not a section of ``ServiceConfig`` (a scheduler's, say) holds
    none of the service's setting names: it would be a second copy to keep in sync."""
    names = {name for _, _, name in settings()} - {"name", "description"}  # what a thing is called: not knobs
    tree = sections()
    for module in (config, scheduling):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseModel) and cls.__module__ == module.__name__ and cls not in tree:
                assert not names & set(cls.model_fields), (cls.__name__, sorted(names & set(cls.model_fields)))


def test_a_mirror_of_a_section_would_be_caught():
    """The check above is not vacuous: a model that repeats a dispatch knob fails it."""

    class Mirror(BaseModel):
        queue_order: str = "fifo"

    class WithMirror(ServiceConfig):
        mirror: Mirror = Mirror()

    defined: dict[str, set[type[BaseModel]]] = {}
    for _, model, name in settings(WithMirror):
        defined.setdefault(name, set()).add(model)
    assert {m.__name__ for m in defined["queue_order"]} == {"DispatchSettings", "Mirror"}


def test_the_backbone_settings_are_the_models_config_type():
    from nexus.model import backbone

    assert backbone.BackboneConfig is config.BackboneConfig
    assert ServiceConfig.model_fields["backbone"].annotation is config.BackboneConfig


def test_every_setting_has_a_description():
    missing = [path for path, model, name in settings()
               if not model.model_fields[name].description and not path.startswith(UNDESCRIBED_OK)]
    sections_missing = [f"{path}" for path, f in _section_fields() if not f.description]
    assert not missing and not sections_missing, (missing, sections_missing)


def _section_fields(model: type[BaseModel] = ServiceConfig, prefix: str = "") -> list:
    out = []
    for name, f in model.model_fields.items():
        subs = _models(f.annotation)
        if subs and not (prefix + name + ".").startswith(UNDESCRIBED_OK):
            out.append((prefix + name, f))
            for sub in subs:
                out += _section_fields(sub, f"{prefix}{name}.")
    return out


def test_scheduler_files_set_exactly_service_config_keys():
    leaves = {path for path, _, _ in settings()} - {"root", "scheduler"}

    def keys(doc: dict, prefix: str = "") -> set[str]:
        return {k for key, v in doc.items()
                for k in (keys(v, f"{prefix}{key}.") if isinstance(v, dict) else {prefix + key})}

    files = sorted((REPO / "schedulers").glob("*.toml"))
    assert files
    for f in files:
        doc = tomllib.loads(f.read_text())
        assert isinstance(doc.pop("description"), str), f  # the one key of the scheduler itself
        assert keys(doc) <= leaves, (f.name, sorted(keys(doc) - leaves))
        assert Scheduler.load(f.stem).settings == doc
