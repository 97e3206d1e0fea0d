"""Whether a folder can be served as a model repository: readable, and not one level too deep.

Checked once at start, as Triton checks its repository: a server whose repository is wrong would report ready
and serve nothing (a version folder passed as the repository), or never become ready and answer 500 (a folder
its user cannot read, as a host folder mounted 0700 into the image, whose user is uid 10001).
"""
from __future__ import annotations

import os
from pathlib import Path

MODEL_FILE = "model.safetensors"


def repository_problem(root: Path) -> str | None:
    """What is wrong with ``root`` as a model repository, said as the fix; None when it can be served."""
    if not root.is_dir():
        return (f"model repository '{root}' is not a folder; pass --repository DIR (or RNNSERVE_REPOSITORY) naming a "
                f"folder of models (an empty one serves none until models are added and loaded)")
    try:
        entries = list(os.scandir(root))
    except OSError as exc:
        return (f"model repository '{root}' cannot be read ({exc.strerror or exc}); give the server's user "
                f"(uid {os.getuid()}) read and execute permission on it, or run as its owner")
    names = {e.name for e in entries}
    if MODEL_FILE in names:
        return (f"'{root}' is a model's version folder (it holds {MODEL_FILE}), not a model repository; pass the "
                f"folder two levels up, which holds one folder per model (REPO/<name>/<version>/{MODEL_FILE})")
    folders = [e for e in entries if _is_folder(e) and not e.name.startswith(".")]
    versions_with_file = [e.name for e in folders if e.name.isdigit() and (Path(e.path) / MODEL_FILE).is_file()]
    if versions_with_file and all(e.name.isdigit() for e in folders):
        versions = ", ".join(sorted(versions_with_file, key=int)[:3])
        return (f"'{root}' is a model folder (its version folders {versions} hold {MODEL_FILE}), not a model "
                f"repository; pass its parent folder, which holds one folder per model")
    return None


def _is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False
