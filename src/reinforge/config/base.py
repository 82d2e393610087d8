"""The base of every config section: unknown keys refused, each field's docstring its description,
values re-validated on assignment.

It lives apart from config.py so that section modules beside it (config/envs.py) can build on it
while config.py imports them into its unions.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Seeds go to numpy (which takes 0 .. 2**32 - 1) and torch, and per-step seeds are derived from
# them by multiplying (train/loop/rl.py): a larger seed overflows those 64-bit seeds.
MAX_SEED = 2**32 - 1


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )
