"""The repository folder checked at start: readable, and not a model or version folder passed by mistake."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

import pytest

from service.app import serve_main
from service.errors import InvalidInput, NotFound, Unavailable
from service.registry import ModelRegistry
from service.repository.model import model_versions, unserved_folders
from service.repository.root_check import repository_problem

MODELS = Path(__file__).resolve().parents[2] / "models"


@contextlib.asynccontextmanager
async def _serving(repo: Path, monkeypatch):
    """A started registry of ``repo``, stopped (the test's patches undone first) however the test ends."""
    registry = ModelRegistry(repo, device="cpu")
    await registry.start()
    try:
        yield registry
    finally:
        monkeypatch.undo()
        await registry.stop()


def _repository(tmp_path: Path, *names: str) -> Path:
    """A repository holding the bundled forecaster under each of ``names``."""
    repo = tmp_path / "repo"
    for name in names:
        shutil.copytree(MODELS / "forecaster", repo / name)
    return repo


def test_the_bundled_repository_can_be_served():
    assert repository_problem(MODELS) is None


def test_a_model_or_version_folder_passed_as_the_repository_is_refused_at_start(tmp_path, capsys):
    """Both started: the version folder ready, serving nothing (a rollout would pass its readiness probe), the model
    folder with a model named '1' that failed to load."""
    repo = _repository(tmp_path, "forecaster")
    assert "is a model folder (its version folders 1 hold model.safetensors), not a model repository; pass its " \
           "parent folder" in repository_problem(repo / "forecaster")
    assert "is a model's version folder (it holds model.safetensors), not a model repository; pass the folder two " \
           "levels up" in repository_problem(repo / "forecaster" / "1")
    assert serve_main(["--repository", str(repo / "forecaster" / "1"), "--http-port", "0", "--grpc-port", "0"]) == 2
    assert "is a model's version folder" in capsys.readouterr().err
    (repo / "forecaster" / "2").mkdir()  # an empty newer version folder beside it: still a model folder
    assert "its version folders 1 hold model.safetensors" in repository_problem(repo / "forecaster")
    (repo / "forecaster" / "notes").mkdir()  # nor does a folder beside them that holds no model
    assert "is a model folder" in repository_problem(repo / "forecaster")
    (repo / "forecaster" / "backup").mkdir()  # nor one with a model file that is no version (it raised ValueError)
    shutil.copy(repo / "forecaster" / "1" / "model.safetensors", repo / "forecaster" / "backup")
    assert "its version folders 1 hold" in repository_problem(repo / "forecaster")


def test_a_repository_with_a_misplaced_file_beside_its_models_is_served(tmp_path):
    """What a first version of the check refused though its models served: a stray model file at the top, and
    models named by numbers one of which has its file one level too high."""
    repo = _repository(tmp_path, "forecaster")
    shutil.copy(MODELS / "forecaster" / "1" / "model.safetensors", repo / "model.safetensors")
    assert repository_problem(repo) is None
    numbers = tmp_path / "numbers"
    shutil.copytree(MODELS / "forecaster", numbers / "7")
    (numbers / "8").mkdir(parents=True)
    shutil.copy(MODELS / "forecaster" / "1" / "model.safetensors", numbers / "8" / "model.safetensors")
    assert repository_problem(numbers) is None


def test_a_repository_that_can_be_listed_but_not_entered_is_refused(tmp_path, monkeypatch):
    """Mode 0744 for another user: listed, but its folders cannot be entered. The check passed (or raised
    PermissionError from Path.is_file), and the server served nothing."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == tmp_path else real(path, mode))
    assert "cannot be read (Permission denied)" in repository_problem(tmp_path)


def test_a_repository_the_server_cannot_read_is_refused_at_start(tmp_path, monkeypatch):
    """As a user without permission (a host folder mounted 0700 into the image): the server started, never became
    ready, listed an empty index and answered loads with a bare 500."""
    real = os.scandir

    def refused(path):
        if Path(path) == tmp_path:
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(os, "scandir", refused)
    problem = repository_problem(tmp_path)
    assert problem is not None and "cannot be read (Permission denied); give the server's user (uid" in problem


@pytest.mark.asyncio
async def test_a_repository_that_becomes_unreadable_answers_loads_with_unavailable(tmp_path, monkeypatch):
    """Permissions changed under a running server: a load or unload answered a bare 500 (PermissionError)."""
    repo = _repository(tmp_path, "forecaster")
    async with _serving(repo, monkeypatch) as registry:
        real = Path.is_dir

        def refused(path):
            if path.parent == repo:
                raise PermissionError(13, "Permission denied")
            return real(path)

        monkeypatch.setattr(Path, "is_dir", refused)
        with pytest.raises(Unavailable, match=r"forecaster cannot be read \(Permission denied\); "
                                              r"give the server's user read and execute permission on it"):
            await registry.load("forecaster")
        await registry.unload("forecaster")  # needs no file: done, and the model stays listed as unloaded
        await registry.forget_removed()  # what the index does first: it answered 503 while the repository was shut
        assert [(r["name"], r["reason"]) for r in registry.index()] == [("forecaster", "unloaded")]
        with pytest.raises(NotFound, match="unknown model 'other'"):  # not 503: nothing says it will come
            registry.entry("other")


@pytest.mark.asyncio
async def test_a_version_folder_without_a_model_file_is_logged(tmp_path, caplog):
    """A newer version copied in halfway (2/ with no model.safetensors yet) left version 1 serving with no word."""
    repo = _repository(tmp_path, "forecaster")
    (repo / "forecaster" / "2").mkdir()
    (repo / "forecaster" / "docs").mkdir()
    (repo / "gone").symlink_to(tmp_path / "nowhere")  # a link to a model folder that is not there: left out unsaid
    registry = ModelRegistry(repo, device="cpu")
    with caplog.at_level(logging.WARNING, logger="rnnserve.registry"):
        await registry.start()
        await registry.stop()
    assert "model forecaster: folder(s) '2' (no model.safetensors) hold no servable version and are left out " \
           "(versions with a model: 1)" in caplog.text, caplog.text
    assert f"model folder {repo / 'gone'} is a link to {tmp_path / 'nowhere'}, which cannot be followed (missing, " \
           f"or a loop): left out" in caplog.text
    assert "'docs'" not in caplog.text  # a folder that is no version is not warned about on every load


@pytest.mark.asyncio
async def test_a_model_folder_that_cannot_be_looked_at_fails_alone(tmp_path, monkeypatch):
    """A link into a folder the server may not enter raised out of the scan: the server never became ready and
    listed nothing. Now that model is UNAVAILABLE with why, and the others serve."""
    repo = _repository(tmp_path, "forecaster")
    (repo / "locked").mkdir()
    real_dir, real_exists = Path.is_dir, Path.exists

    def guarded(real):
        def test(path):
            if path == repo / "locked":
                raise PermissionError(13, "Permission denied")
            return real(path)
        return test

    monkeypatch.setattr(Path, "is_dir", guarded(real_dir))
    monkeypatch.setattr(Path, "exists", guarded(real_exists))
    async with _serving(repo, monkeypatch) as registry:
        rows = {r["name"]: r for r in registry.index()}
    assert rows["forecaster"]["state"] == "READY"
    assert rows["locked"]["state"] == "UNAVAILABLE" and "locked cannot be read (Permission denied)" in \
        rows["locked"]["reason"], rows["locked"]


def test_a_version_folder_that_cannot_be_entered_leaves_the_others_serving(tmp_path, monkeypatch):
    """A locked version folder 2 beside a good 1 made the whole model UNAVAILABLE (PermissionError)."""
    model = tmp_path / "m"
    shutil.copytree(MODELS / "forecaster" / "1", model / "1")
    (model / "2").mkdir()
    real = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
                        if p.parent == model / "2" else real(p))
    assert model_versions(model) == [1]
    assert unserved_folders(model) == ["'2' (cannot be read: give the server's user read and execute permission on "
                                       "it)"]


def test_a_repository_inside_a_folder_the_server_may_not_enter_is_refused(tmp_path, monkeypatch):
    """Its is_dir() raised PermissionError out of the check: a traceback at start instead of the one-line refusal."""
    repo = tmp_path / "locked" / "repo"
    real = Path.is_dir

    def refused(path):
        if path == repo:
            raise PermissionError(13, "Permission denied")
        return real(path)

    def denied(path, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "is_dir", refused)
    monkeypatch.setattr(Path, "stat", denied)
    problem = repository_problem(repo)
    assert problem is not None and "cannot be read (Permission denied)" in problem, problem


def test_a_version_link_that_cannot_be_followed_leaves_the_others_serving(tmp_path, monkeypatch):
    """A version folder that is a link into a locked folder: unserved_folders' is_dir() raised, and the whole model
    failed (model_versions had been fixed for a locked folder, not for a link)."""
    model = tmp_path / "m"
    shutil.copytree(MODELS / "forecaster" / "1", model / "1")
    (model / "2").mkdir()
    real_dir, real_exists = Path.is_dir, Path.exists

    def guarded(real):
        def test(path):
            if path == model / "2" or path.parent == model / "2":
                raise PermissionError(13, "Permission denied")
            return real(path)
        return test

    monkeypatch.setattr(Path, "is_dir", guarded(real_dir))
    monkeypatch.setattr(Path, "exists", guarded(real_exists))
    assert model_versions(model) == [1]
    assert unserved_folders(model) == ["'2' (cannot be read: give the server's user read and execute permission on "
                                       "it)"]


@pytest.mark.asyncio
async def test_one_link_that_cannot_be_followed_does_not_hide_the_models_added_since_start(tmp_path, monkeypatch):
    """The index's rows for folders added after start came from one scan that gave up at the first link it could
    not follow: every added model vanished from the index."""
    repo = _repository(tmp_path, "forecaster")
    async with _serving(repo, monkeypatch) as registry:
        shutil.copytree(MODELS / "forecaster", repo / "added")
        (repo / "locked").mkdir()
        real = Path.is_dir
        monkeypatch.setattr(Path, "is_dir", lambda p: (_ for _ in ()).throw(PermissionError(13, "denied"))
                            if p == repo / "locked" else real(p))
        assert "added" in registry.unseen()


@pytest.mark.asyncio
async def test_a_model_folder_the_server_cannot_read_says_the_fix(tmp_path, monkeypatch):
    """Its reason was Python's own words: "cannot be read: PermissionError: [Errno 13] Permission denied: ..."."""
    from service.registry import registry as registry_module

    repo = _repository(tmp_path, "x")
    registry = ModelRegistry(repo, device="cpu")

    def denied(model_dir, defaults):
        raise PermissionError(13, "Permission denied", str(model_dir / "config.json"))

    monkeypatch.setattr(registry_module, "effective_config", denied)
    with pytest.raises(InvalidInput, match=r"model folder .*x cannot be read \(Permission denied: .*config.json\); "
                                           r"give the server's user read and execute permission on it"):
        await registry.load("x")
