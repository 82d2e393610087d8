"""Per-file hashes of a checkpoint, written with it and checked before a resume loads it.

Every checkpoint folder holds `manifest.json`: each file's path (relative to the folder), size
and xxh3-128 hash (xxhash: ~7 GB/s on one core, so hashing costs a few percent of the write it
follows; sha256 would cost ~20%). `publish` writes it after the last file and before the folder
is fsynced and renamed, so a folder under its final name always carries the hashes of the bytes
it was written with.

Before a resume (`choose_intact`) the folder `latest` names is checked against its manifest: a
missing, truncated or altered file (a flipped bit in `model.safetensors`) is damage. With
`checkpoint.on_damaged = "previous"` the damage is reported, the damaged folder is renamed aside
(`damaged-NAME`, kept for a post-mortem, never loaded or pruned) and the newest intact earlier
checkpoint becomes `latest`; with "error" the run stops, naming the damage and that choice.
A folder without a manifest (written before manifests existed) is accepted unverified, with a note.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import xxhash

from reinforge.errors import RunFailure

MANIFEST = "manifest.json"
HASH_NAME = "xxh3_128"
DAMAGED_PREFIX = "damaged-"
_CHUNK_BYTES = 8 << 20

OnDamaged = Literal["previous", "error"]


class CheckpointDamaged(RunFailure):
    """The checkpoint a resume would load does not match its manifest."""


def file_hash(path: Path) -> str:
    digest = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while num_read := f.readinto(buffer):
            digest.update(view[:num_read])
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Hash every file under `folder` into `folder/manifest.json`."""
    files = {
        path.relative_to(folder).as_posix(): {
            "bytes": path.stat().st_size,
            "hash": file_hash(path),
        }
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    (folder / MANIFEST).write_text(json.dumps({"hash": HASH_NAME, "files": files}, indent=1))


def find_damage(folder: Path) -> list[str] | None:
    """What in `folder` differs from its manifest ([] when nothing does); None when it has no
    manifest to check against."""
    path = folder / MANIFEST
    if not path.exists():
        return None if (folder / "trainer_state.json").exists() else ["trainer_state.json: missing"]
    try:
        manifest = json.loads(path.read_text())
        files, hash_name = dict(manifest["files"]), manifest["hash"]
    except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
        return [f"{MANIFEST}: unreadable ({type(e).__name__}: {e})"]
    if hash_name != HASH_NAME:
        return [f"{MANIFEST}: hashed with {hash_name!r}, which this version cannot check"]
    problems = []
    for name, entry in files.items():
        file = folder / name
        if not file.is_file():
            problems.append(f"{name}: missing")
        elif (size := file.stat().st_size) != entry["bytes"]:
            problems.append(
                f"{name}: {size} bytes, the manifest says {entry['bytes']} (truncated?)"
            )
        elif file_hash(file) != entry["hash"]:
            problems.append(f"{name}: its bytes differ from the manifest's hash (altered on disk)")
    return problems


def choose_intact(root: Path, latest: str, on_damaged: OnDamaged, order) -> tuple[str, list[str]]:
    """The checkpoint a resume loads: `latest` when intact, else (on_damaged = "previous") the
    newest intact earlier one, the damaged ones renamed aside. Returns its name and what to
    report. `order` sorts checkpoint names by position in the run."""
    damage = find_damage(root / latest)
    if damage is None:
        return latest, [f"resume: checkpoint {latest} has no {MANIFEST}; loaded unverified"]
    if not damage:
        return latest, []
    notes = [f"checkpoint {latest} in {root} is damaged: {'; '.join(damage)}"]
    damaged = [latest]
    earlier = sorted(
        (p.name for p in root.iterdir() if p.is_dir() and order(p.name) < order(latest)),
        key=order,
        reverse=True,
    )
    chosen = None
    for name in earlier:
        if order(name) < (0, 0):
            continue  # not a checkpoint folder (a damaged one set aside, a temporary one)
        problems = find_damage(root / name)
        if not problems:
            chosen = name
            break
        notes.append(f"checkpoint {name} is damaged too: {'; '.join(problems)}")
        damaged.append(name)
    if chosen is None:
        raise CheckpointDamaged(
            f"{' '.join(notes)}; no earlier checkpoint is intact, so there is nothing to resume: "
            "start a new run (without --resume), or restore the files"
        )
    if on_damaged == "error":
        raise CheckpointDamaged(
            f"{' '.join(notes)}. The newest intact checkpoint is {chosen}: resume from it with "
            f"checkpoint.on_damaged=previous (the damaged folders are then kept as "
            f"{DAMAGED_PREFIX}NAME), or restore the damaged files"
        )
    for name in damaged:
        os.replace(root / name, _aside(root, name))
    notes.append(f"resuming from {chosen}, the newest intact checkpoint (checkpoint.on_damaged)")
    return chosen, notes


def _aside(root: Path, name: str) -> Path:
    path = root / f"{DAMAGED_PREFIX}{name}"
    count = 1
    while path.exists():
        count += 1
        path = root / f"{DAMAGED_PREFIX}{name}.{count}"
    return path
