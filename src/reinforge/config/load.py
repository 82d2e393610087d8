"""Loading a config: TOML plus `section.key=value` overrides, key checking, validation, and the
messages for what is refused; `to_toml` writes a config back.

Unknown or misplaced keys are refused before validation with the closest valid key and, when the
key belongs to another section, the section to move it to. Validation errors name the dotted key
and an example value. Nothing here knows the roots; config.py defines them and imports this.
"""

from __future__ import annotations

import copy
import difflib
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Union, get_args

from pydantic import BaseModel, ValidationError

from reinforge.config.base import Section
from reinforge.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_config(
    root: type[Section],
    path: str | Path | None,
    overrides: list[str] = (),
    base: dict[str, Any] | None = None,
) -> Any:
    """Read TOML, apply `section.key=value` overrides, check keys, validate. `base` holds section
    tables used where the file has none (`reinforge eval RUN_DIR` starts from the run's config);
    a section the file has replaces the base's whole."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist (e.g. configs/quickstart.toml)"
            )
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    raw = {**copy.deepcopy(base or {}), **raw}
    for item in overrides:
        apply_override(raw, item)
    check_keys(raw, root)
    try:
        return root.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, root)) from None


def read_saved_config(path: Path) -> dict[str, Any]:
    """A run's saved `config.toml` as a table, brought up to the current `[algorithm]`
    settings when an earlier reinforge wrote it: `normalize_std` became `scale_rewards`, and
    settings the run's algorithm never read (the PPO ones under grpo, say) were accepted then and
    are dropped now, so the run resumes and evaluates with what it trained with."""
    from reinforge.config.algorithm import AlgorithmSection

    raw = tomllib.loads(path.read_text())
    algorithm = raw.get("algorithm")
    if not isinstance(algorithm, dict) or "name" not in algorithm:
        return raw
    if "normalize_std" in algorithm:
        divide = algorithm.pop("normalize_std")
        algorithm.setdefault("scale_rewards", "group" if divide else "none")
    variants = {v.model_fields["name"].default: v for v in get_args(get_args(AlgorithmSection)[0])}
    model = variants.get(algorithm["name"])
    if model is not None:
        for key in [k for k in algorithm if k not in model.model_fields]:
            del algorithm[key]
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} must look like section.key=value (e.g. rollout.temperature=0.7)"
        )
    dotted, text = item.split("=", 1)
    keys = [k.strip() for k in dotted.strip().split(".")]
    if not all(keys):
        raise ConfigError(f"override {item!r}: empty key in {dotted!r} (e.g. optim.lr=1e-5)")
    value = parse_override_value(text)
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {key!r} is a value, not a section")
    node[keys[-1]] = value


def parse_override_value(text: str) -> Any:
    """A TOML value (`0.7`, `true`, `[1, 2]`, `"text"`); a bare word is a string
    (`model.path=/data/ckpt`); `null` unsets the key (None: the setting's "not set", e.g.
    `task.eval_path=null`); the string "null" is written `'"null"'`."""
    if text.strip() == "null":
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _variants(annotation: Any) -> list[type[BaseModel]]:
    """The section models an annotation can hold (several for a union on `name`)."""
    from typing import get_args, get_origin

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    origin = get_origin(annotation)
    if origin is Annotated or origin is Union or origin is types.UnionType:
        for arg in get_args(annotation):
            out.extend(_variants(arg))
    return out


def _pick_variant(
    variants: list[type[BaseModel]], raw: dict[str, Any], where: str
) -> type[BaseModel]:
    if len(variants) == 1:
        return variants[0]
    names = {v.model_fields["name"].default: v for v in variants}
    chosen = raw.get("name", next(iter(names)))
    if chosen not in names:
        close = difflib.get_close_matches(str(chosen), list(names), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"[{where}] name = {chosen!r} is not known; {hint}choose one of {sorted(names)}"
        )
    return names[chosen]


def _all_locations(root: type[BaseModel]) -> dict[str, list[str]]:
    """key -> sections it is valid in, across every variant."""
    where: dict[str, list[str]] = {}
    for sec_name, field in root.model_fields.items():
        for variant in _variants(field.annotation):
            label = sec_name
            if len(_variants(field.annotation)) > 1:
                label = f"{sec_name}] with name = {variant.model_fields['name'].default!r} ["
            for key in variant.model_fields:
                where.setdefault(key, [])
                if label not in where[key]:
                    where[key].append(label)
    return where


def check_keys(raw: dict[str, Any], root: type[BaseModel]) -> None:
    """Refuse unknown or misplaced keys, naming the closest valid key or the right section."""
    locations = _all_locations(root)
    for sec_name, sec_raw in raw.items():
        if sec_name not in root.model_fields:
            if not isinstance(sec_raw, dict) and sec_name in locations:
                places = " or ".join(f"[{s}]".replace(" []", "") for s in locations[sec_name])
                raise ConfigError(
                    f"{sec_name!r} is at the top level of the config, but it belongs in {places}: move it there"
                )
            close = difflib.get_close_matches(sec_name, list(root.model_fields), n=1)
            hint = f"did you mean [{close[0]}]? " if close else ""
            raise ConfigError(
                f"unknown section [{sec_name}]; {hint}sections are {list(root.model_fields)}"
            )
        if not isinstance(sec_raw, dict):
            raise ConfigError(f"[{sec_name}] must be a table of settings, got {sec_raw!r}")
        variants = _variants(root.model_fields[sec_name].annotation)
        model = _pick_variant(variants, sec_raw, sec_name)
        if len(variants) > 1:
            sec_raw.setdefault("name", model.model_fields["name"].default)
        for key in sec_raw:
            if key in model.model_fields:
                _check_nested(sec_raw[key], model.model_fields[key].annotation, f"{sec_name}.{key}")
                continue
            elsewhere = [s for s in locations.get(key, []) if s != sec_name]
            if elsewhere:
                places = " or ".join(f"[{s}]".replace(" []", "") for s in elsewhere)
                raise ConfigError(
                    f"[{sec_name}] has no setting {key!r}: {key!r} belongs in {places}; move it there"
                )
            close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"[{sec_name}] has no setting {key!r}; {hint}valid settings: {', '.join(model.model_fields)}"
            )


def _check_nested(raw: Any, annotation: Any, where: str) -> None:
    """Keys of a table inside a section (e.g. `[model.lora]`): unknown ones name the closest."""
    if not isinstance(raw, dict) or not (
        isinstance(annotation, type) and issubclass(annotation, BaseModel)
    ):
        return
    for key, value in raw.items():
        if key not in annotation.model_fields:
            close = difflib.get_close_matches(key, list(annotation.model_fields), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"[{where}] has no setting {key!r}; {hint}valid settings: "
                f"{', '.join(annotation.model_fields)}"
            )
        _check_nested(value, annotation.model_fields[key].annotation, f"{where}.{key}")


def format_validation_error(err: ValidationError, root: type[BaseModel]) -> str:
    tags = {
        v.model_fields["name"].default
        for f in root.model_fields.values()
        for v in _variants(f.annotation)
        if len(_variants(f.annotation)) > 1
    }
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if str(p) not in tags)
        default = _default_at(root, [str(p) for p in e["loc"]])
        example = f"; e.g. {loc} = {default!r}" if default is not None else ""
        got = f" (got {e['input']!r})" if not isinstance(e.get("input"), dict) else ""
        message = e["msg"].removeprefix("Value error, ") + got + example
        lines.append(f"{loc}: {message}" if loc else message)
    return "invalid config:\n  " + "\n  ".join(lines)


def _default_at(root: type[BaseModel], loc: list[str]) -> Any:
    model: Any = root
    value: Any = None
    for part in loc:
        if isinstance(model, type) and issubclass(model, BaseModel) and part in model.model_fields:
            field = model.model_fields[part]
            variants = _variants(field.annotation)
            value = field.default
            model = variants[0] if variants else None
        elif isinstance(model, type) and issubclass(model, BaseModel):
            continue  # union tag in the location
        else:
            return None
    return None if isinstance(value, BaseModel) else value


def to_toml(cfg: BaseModel) -> str:
    import tomli_w

    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True))
