"""The config reference, generated from the pydantic models' field docs so it cannot drift.

`reinforge config-docs -o docs/config.md` rewrites it; a test fails when the committed file differs.
"""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from reinforge.config import ROOTS
from reinforge.config.load import _variants


def _type_name(annotation: Any) -> str:
    """`int`, `one of a, b`, `float or None`: readable, and free of `|` (the table's separator)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is Union or origin is types.UnionType:
        return " or ".join(_type_name(a) for a in args)
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _fmt_default(value: Any) -> str:
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, str):
        return f'`"{value}"`'
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
        return "`[" + ", ".join(_inline_table(v) for v in value) + "]`"
    return f"`{value}`"


def _inline_table(model: BaseModel) -> str:
    """A section value as a TOML inline table, its unset (None) keys left out."""
    items = model.model_dump(mode="json", exclude_none=True).items()
    return "{" + ", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in items) + "}"


def _bounds(field) -> str:
    parts = []
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{sym} {getattr(m, attr)}")
    return ", ".join(parts)


def _section_table(model: type[BaseModel], where: str, keys: list[str] | None = None) -> list[str]:
    """The section's table (only `keys` when given), then one for each table nested in it (e.g.
    `[model.lora]`)."""
    lines = ["| key | type | default | bounds | description |", "|---|---|---|---|---|"]
    nested = []
    fields = sorted(model.model_fields.items(), key=lambda item: item[0] != "name")  # name first
    for name, field in fields:
        if keys is not None and name not in keys:
            continue
        doc = " ".join((field.description or "").split()).replace("|", "\\|")
        assert doc, f"{model.__name__}.{name} has no docstring"
        if _is_table(field.annotation):
            nested.append((f"{where}.{name}", field.annotation))
            lines.append(f"| `{name}` | table | | | {doc} See `[{where}.{name}]`. |")
            continue
        item = _table_list_item(field.annotation)
        if item is not None:  # a list of tables: `[[section.key]]`, or inline `key = [{...}]`
            nested.append((f"[{where}.{name}]", item))
            lines.append(
                f"| `{name}` | list of tables | {_fmt_default(field.default)} | | {doc} Each "
                f"entry: see `[[{where}.{name}]]`. |"
            )
            continue
        lines.append(
            f"| `{name}` | {_type_name(field.annotation)} | {_fmt_default(field.default)} | "
            f"{_bounds(field)} | {doc} |"
        )
    for sub_where, sub_model in nested:
        lines += ["", f"### `[{sub_where}]`", "", *_section_table(sub_model, sub_where)]
    return lines


def _is_table(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _table_list_item(annotation: Any) -> type[BaseModel] | None:
    """The section model of a `list[Section]` annotation, else None."""
    args = get_args(annotation)
    if get_origin(annotation) is list and len(args) == 1 and _is_table(args[0]):
        return args[0]
    return None


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from the config models' field docs by `reinforge config-docs -o docs/config.md`; "
        "do not edit by hand.",
        "",
        "Every key can be set in the TOML file or on the command line as `section.key=value`. "
        "An unknown or misplaced key is an error that names the right one.",
        "",
    ]
    seen: set[str] = set()
    for command, root in ROOTS.items():
        out += [
            f"## `reinforge {command}`",
            "",
            (root.__doc__ or "").strip(),
            "",
            "Sections: " + ", ".join(f"`[{s}]`" for s in root.model_fields),
            "",
        ]
    users = _commands_by_model()
    for root in ROOTS.values():
        for section, field in root.model_fields.items():
            variants = _variants(field.annotation)
            shared = _shared_keys(variants)
            if shared and variants[0].__name__ not in seen:
                names = ", ".join(f"`{v.model_fields['name'].default}`" for v in variants)
                out += [
                    f"### `[{section}]`: settings of every `name`",
                    "",
                    f"`name` is one of {names}; each takes these settings and its own below.",
                    "",
                    *_section_table(variants[0], section, shared),
                    "",
                ]
            for variant in variants:
                key = variant.__name__
                if key in seen:
                    continue
                seen.add(key)
                title = f"### `[{section}]`"
                if len(variants) > 1:
                    title += f' with `name = "{variant.model_fields["name"].default}"`'
                elif len(users[section]) > 1:  # e.g. [eval] of training vs of `reinforge eval`
                    title += " in " + ", ".join(f"`reinforge {c}`" for c in users[section][key])
                own = [k for k in variant.model_fields if k not in shared]
                out += [title, "", *_section_table(variant, section, own), ""]
    return "\n".join(out)


def _shared_keys(variants: list[type[BaseModel]]) -> list[str]:
    """Settings every variant of a union declares alike (same type, default and docs), besides
    `name`: written once for the section (e.g. `[algorithm]`'s policy-loss settings). Empty for
    a single model."""
    if len(variants) < 2:
        return []

    def spec(model: type[BaseModel], key: str) -> tuple:
        f = model.model_fields[key]
        return (repr(f.annotation), repr(f.default), f.description, repr(f.metadata))

    first = variants[0]
    return [
        k
        for k in first.model_fields
        if k != "name"
        and all(k in v.model_fields and spec(v, k) == spec(first, k) for v in variants[1:])
    ]


def _commands_by_model() -> dict[str, dict[str, list[str]]]:
    """section -> model name -> the commands whose section is that model (one-model sections)."""
    users: dict[str, dict[str, list[str]]] = {}
    for command, root in ROOTS.items():
        for section, field in root.model_fields.items():
            variants = _variants(field.annotation)
            if len(variants) == 1:
                models = users.setdefault(section, {})
                models.setdefault(variants[0].__name__, []).append(command)
    return users
