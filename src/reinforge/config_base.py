"""The base of every config section: unknown keys refused, each field's docstring its description,
values re-validated on assignment.

It lives apart from config.py so that section modules beside it (config_envs.py) can build on it
while config.py imports them into its unions.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )
