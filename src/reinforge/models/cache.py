"""reinforge's cache of built entries (built-in models with their tokenizer, shape folders).

Contract: any number of processes, on one node or many (each node with its own cache, or one
shared), may ask for the same entry at once. One process per cache builds it, holding a file
lock (`filelock`, an OS lock released when the holder dies); the others wait on the lock and
then read what it built. The entry is written into a temporary folder beside it, its manifest
(every file's name and size) written last, and the folder renamed into place: a half-written
entry is never visible under its name. An entry whose manifest is missing or does not match its
files (a crash of an older version, a disk that filled up, a hand-edited folder) is moved aside
and rebuilt, with a note on stderr.

The builders write their files whatever the process group says: transformers' `save_pretrained`
writes weights on global rank 0 only, so under torchrun a builder on another rank would publish
a folder without weights (the first multi-node run's failure this module fixes).

reinforge caches no compiled kernels of its own; Triton keeps its own cache (~/.triton).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

MANIFEST = "reinforge_entry.json"


def cache_dir() -> Path:
    """The node's cache: $REINFORGE_CACHE, else ~/.cache/reinforge."""
    return Path(os.environ.get("REINFORGE_CACHE", Path.home() / ".cache" / "reinforge"))


def is_complete(entry: Path) -> bool:
    """`entry` holds every file its manifest lists, at the listed sizes."""
    try:
        files = json.loads((entry / MANIFEST).read_text())["files"]
        return all((entry / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def cached_entry(name: str, build: Callable[[Path], None]) -> Path:
    """The cache's folder `name`, built by `build(folder)` on first use (see the module
    docstring for who builds and who waits)."""
    root = cache_dir()
    entry = root / name
    if is_complete(entry):
        return entry
    from filelock import FileLock

    (root / ".locks").mkdir(parents=True, exist_ok=True)
    with FileLock(root / ".locks" / f"{name}.lock"):
        if is_complete(entry):  # built by the process that held the lock before us
            return entry
        if entry.exists():
            _set_aside(entry)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}.") as tmp:
            staged = Path(tmp) / name
            build(staged)
            write_manifest(staged)
            try:
                os.replace(staged, entry)
            except OSError:  # a builder on another node won (a shared cache whose filesystem
                if not is_complete(entry):  # does not honour the lock): its entry is as good
                    raise
    assert is_complete(entry), entry
    return entry


def write_manifest(folder: Path) -> None:
    files = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    assert files, f"the builder wrote nothing into {folder}"
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def _set_aside(entry: Path) -> None:
    """Move a broken entry out of the way (then delete it), saying so."""
    print(
        f"reinforge: cache entry {entry} is incomplete (no or mismatched {MANIFEST}); rebuilding it",
        file=sys.stderr,
    )
    broken = entry.with_name(f".{entry.name}.broken-{os.getpid()}")
    os.replace(entry, broken)
    shutil.rmtree(broken, ignore_errors=True)
