"""Whether a folder can be served as a model repository: readable, and not one level too deep.

Checked once at start, as Triton checks its repository: a server whose repository is wrong would report ready
and serve nothing (a version folder passed as the repository), or never become ready and answer 500 (a folder
its user cannot read, as a host folder mounted 0700 into the image, whose user is uid 10001).
"""
from __future__ import annotations

import os
from pathlib import Path

from .files import looked_at
from .model import version_number

MODEL_FILE = "model.safetensors"


def repository_problem(root: Path) -> str | None:
    """What is wrong with ``root`` as a model repository, said as the fix; None when it can be served."""
    if not looked_at(root.is_dir, True):
        return (f"model repository '{root}' is not a folder; pass --repository DIR (or RNNSERVE_REPOSITORY) naming a "
                f"folder of models (an empty one serves none until models are added and loaded)")
    try:
        root.stat()  # inside a folder the server may not enter: refused here, where it raised out of is_dir
        entries = list(os.scandir(root))
        if not os.access(root, os.R_OK | os.X_OK):  # listed, but its folders cannot be entered
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        return (f"model repository '{root}' cannot be read ({exc.strerror or exc}); give the server's user "
                f"(uid {os.getuid()}) read and execute permission on it, or run as its owner")
    folders = [Path(e.path) for e in entries if looked_at(Path(e.path).is_dir, False) and not e.name.startswith(".")]
    if any(_is_model_folder(f) for f in folders):
        return None  # a repository, whatever else lies beside its models (a stray file, a misplaced version)
    if any(e.name == MODEL_FILE for e in entries):
        return (f"'{root}' is a model's version folder (it holds {MODEL_FILE}), not a model repository; pass the "
                f"folder two levels up, which holds one folder per model (REPO/<name>/<version>/{MODEL_FILE})")
    if _is_model_folder(root):
        versions = ", ".join(sorted((f.name for f in folders if _is_version(f)), key=int)[:3])
        return (f"'{root}' is a model folder (its version folders {versions} hold {MODEL_FILE}), not a model "
                f"repository; pass its parent folder, which holds one folder per model")
    return None


def _is_model_folder(folder: Path) -> bool:
    """A folder holding a version folder with a model file: what a repository holds, one per model."""
    try:
        return any(_is_version(Path(e.path)) for e in os.scandir(folder))
    except OSError:
        return False


def _is_version(folder: Path) -> bool:
    """A version folder as the registry reads one (1, 2, ...: not 01 or a backup) that holds a model file."""
    return version_number(folder.name) is not None and looked_at((folder / MODEL_FILE).is_file, False)
