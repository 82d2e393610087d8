"""Where `model.path` points: a local folder, or a name on the Hugging Face hub.

Checked before transformers sees it, so a mistyped folder gets a message about the folder (not
the hub's "Repo id must be in the form ..."), and a hub name without a network fails at once
rather than after the hub client's retries (about 33 s), unless the local cache holds it.
"""

from __future__ import annotations

import functools
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from reinforge.errors import ConfigError

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
EXAMPLES = (
    "an HF checkpoint folder, a hub name such as 'Qwen/Qwen2.5-0.5B-Instruct', or 'builtin:tiny'"
)


def check_model_location(path: str, setting: str = "model.path") -> None:
    """Raise ConfigError when `path` is neither an existing folder nor a hub name this machine
    can fetch or has cached."""
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir() or not (local / "config.json").is_file():
            raise ConfigError(
                f"{setting} = {path!r} exists but is not a model folder (no config.json in it); "
                f"give {EXAMPLES}"
            )
        return
    if not looks_like_hub_name(path):
        raise ConfigError(
            f"{setting} = {path!r}: no such folder ({local.absolute()}); give {EXAMPLES}"
        )
    if is_cached(path) or hub_reachable():
        return
    raise ConfigError(
        f"{setting} = {path!r} is not a local folder, and as a hub name it cannot be fetched: "
        f"{offline_reason()} and it is not in the local Hugging Face cache. Download it where "
        f"there is a network (`hf download {path}`) and give its folder, or use 'builtin:tiny'"
    )


def looks_like_hub_name(path: str) -> bool:
    return bool(HUB_NAME.match(path)) and not path.startswith((".", "~")) and ".." not in path


def is_cached(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def offline_reason() -> str:
    if _offline_env():
        return "HF_HUB_OFFLINE is set"
    return f"{_endpoint()[0]} cannot be reached from here"


def _offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _endpoint() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub answers a TCP connect (once per process); False when HF_HUB_OFFLINE is set."""
    if _offline_env():
        return False
    try:
        socket.create_connection(_endpoint(), timeout=timeout_s).close()
    except OSError:
        return False
    return True
