"""ModelRegistry: the served models, their versions and states, loaded from the repository.

At start every subfolder of the repository is a model; its ``config.json`` chooses
versions (``version_policy``: ``latest`` by default, ``all``, or a list of numbers).
Each served version gets an engine and a :class:`Scheduler`. A folder that cannot be
read, configured or loaded shows as UNAVAILABLE with the reason in the index and
never stops the others. Reading weights and building engines runs in a thread, off
the event loop.

States: LOADING -> READY -> UNLOADING -> UNAVAILABLE (reason "unloaded"); a failed
load is UNAVAILABLE with its error. ``load`` on a served model reloads it: the new
versions are built first and swapped in, then the old ones drain, so requests do
not see a gap. ``ready()`` is true once the startup scan has tried every model:
every loadable model is then READY.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import time
from functools import cached_property
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..engines import create_engine
from ..errors import InvalidInput, NotFound, RNNServeError, Unavailable
from ..metrics import ServerMetrics
from ..repository import ModelConfig, PackedModel, load_config, load_model
from ..repository.files import looked_at
from ..repository.model import model_versions, unserved_folders, version_number
from ..scheduler import MemoryBudget, Scheduler, StreamStore
from .builds import build_off_loop

log = logging.getLogger("rnnserve.registry")
_GENERATIONS = itertools.count(1)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch: '$' also matches before a final newline

# Fields the server's settings give every model unless its config.json says otherwise.
DEFAULTED_FIELDS = ("max_batch_size", "max_queue_delay_us", "max_queue_size", "max_sequence_length",
                    "max_batch_memory_mb", "max_streams",
                    "stream_idle_timeout_s", "frontend_in_flight")


class ModelState(str, Enum):
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"


@dataclass(eq=False)
class ServedVersion:
    """One version of one model and what serves it."""

    name: str
    version: int
    state: ModelState = ModelState.LOADING
    reason: str = ""
    config: ModelConfig | None = None
    model: PackedModel | None = None
    engine: Any = None
    scheduler: Scheduler | None = None
    streams: StreamStore | None = None
    budget: MemoryBudget | None = None
    # Identifies this load of the version across processes (front-ends cache a view of it).
    generation: int = field(default_factory=_GENERATIONS.__next__)

    @cached_property
    def label(self) -> str:
        """The version as the metrics label and API string (read for every request and stream chunk)."""
        return str(self.version)

    @property
    def platform(self) -> str:
        """Engine name as a V2 platform, e.g. rnnserve_reference."""
        return f"rnnserve_{getattr(self.engine, 'name', 'unknown')}"


@dataclass(eq=False)
class ModelEntry:
    """A model folder: its versions, or the reason it has none."""

    name: str
    versions: dict[int, ServedVersion] = field(default_factory=dict)
    state: ModelState = ModelState.UNAVAILABLE
    reason: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # why the last load stopped before any version, while earlier versions still serve ("" when it did not)
    last_failure: str = ""
    # versions whose new copy failed in the last load while their earlier copy still serves: why
    reload_failures: dict[int, str] = field(default_factory=dict)


def effective_config(model_dir: Path, defaults: dict[str, Any]) -> ModelConfig:
    """The model's config.json over the server's defaults.

    A field written in config.json wins; a field the file leaves out takes the
    server's flag/env default (``--max-batch-size`` and friends), then the built-in one.
    """
    cfg = load_config(model_dir)
    update = {k: defaults[k] for k in DEFAULTED_FIELDS if k in defaults and k not in cfg.model_fields_set}
    return cfg.model_copy(update=update)


def check_serving(served: ServedVersion) -> ServedVersion:
    """``served`` when it can run a request now, else Unavailable saying why (callers that count the refusal
    under its version first get the version, then call this)."""
    if served.state != ModelState.READY or served.scheduler is None:
        why = f": {served.reason}" if served.reason else ""
        raise Unavailable(f"model '{served.name}' version {served.version} is not ready "
                          f"(state {served.state.value}{why})")
    return served


def _check_name(name: str) -> None:
    """InvalidInput unless ``name`` can be a model's (and so a folder's that load and unload act on)."""
    if not _NAME.fullmatch(name):
        raise InvalidInput(f"'{name}' is not a model name: use letters, digits, '_', '-', '.', starting "
                           f"with a letter or digit")


class ModelRegistry:
    """Scans ``repository``; loads, serves and unloads model versions."""

    def __init__(self, repository: str | Path, device: str = "cpu", defaults: dict[str, Any] | None = None,
                 metrics: ServerMetrics | None = None) -> None:
        self.repository = Path(repository)
        self.device = device
        self.defaults = dict(defaults or {})
        self.metrics = metrics
        self._models: dict[str, ModelEntry] = {}
        self._scanned = False  # the startup scan has listed the repository's folders (as LOADING)
        self._had_models = False  # it found folders named as models
        self._waiting_for_a_model = False  # it found some and loaded none: not ready until one loads
        self._started = False
        # seconds an idle stream outlives its stream_idle_timeout_s: set where front-end processes hold chunks
        # this process has not seen yet (see StreamStore)
        self.stream_expiry_grace_s = 0.0

    # ---- queries -------------------------------------------------------------------------------

    def ready(self) -> bool:
        """True once the startup scan has tried every model (each loadable one is then READY) and a version serves.

        A repository whose models all failed serves nothing but errors: not ready, so that a rollout of a broken
        repository stops at its first pod and a load balancer sends it nothing (Triton stops at start there). It
        turns ready when a model loads through the API. A repository with no model folder at the start is ready
        (models are added and loaded through the API later). Beyond that, loads and unloads do not flip it: old
        versions keep serving during a reload, and an unloaded model is not loadable (a server whose operator
        unloaded every model stays ready, so that the repository API stays reachable through its Service).
        """
        if not self._started:
            return False
        if self._waiting_for_a_model:  # the start found model folders and loaded none
            if not any(sv.state == ModelState.READY for entry in self._models.values() for sv in entry.versions.values()):
                return False
            self._waiting_for_a_model = False  # from now on, unloading every model is the operator's choice
        return True

    def names(self) -> list[str]:
        return sorted(self._models)

    def entry(self, name: str) -> ModelEntry:
        """The model folder ``name`` or NotFound."""
        try:
            return self._models[name]
        except KeyError:
            folder = False
            with contextlib.suppress(Unavailable):  # an unreadable repository: unknown is all that can be said
                folder = _NAME.fullmatch(name) is not None and self._is_folder(name)
            if folder:  # one stat, not a scan
                if not self._scanned:  # a front-end may ask before the engine process's scan ran
                    raise Unavailable(f"model '{name}' is not ready: the server is starting and loads the "
                                      f"repository's models") from None
                raise NotFound(f"model '{name}' is in repository {self.repository} but not loaded (its folder came "
                               f"after the server started); load it first: POST /v2/repository/models/{name}/load "
                               f"(gRPC RepositoryModelLoad)") from None
            raise NotFound(f"unknown model '{name}'; the repository has {', '.join(self.names()) or 'no models'}") from None

    def _is_folder(self, name: str) -> bool:
        """Whether the repository has a folder ``name``; Unavailable, saying what to fix, when the repository cannot
        be read (its permissions changed under the server: a load or unload answered a bare 500)."""
        try:
            return (self.repository / name).is_dir()
        except OSError as exc:
            raise Unavailable(f"{self.repository / name} cannot be read ({exc.strerror or exc}); give the server's "
                              f"user read and execute permission on it and on the folders above it") from None

    def unseen(self) -> list[str]:
        """Model folders of the repository that this server has not loaded or tried to (added after it started)."""
        try:
            folders = [p.name for p in self.repository.iterdir() if looked_at(p.is_dir, True)]
        except OSError:  # the repository itself cannot be listed; one link that cannot be followed hid every row
            return []
        return sorted(n for n in folders if n not in self._models and _NAME.fullmatch(n))

    def version(self, name: str, version: str = "") -> ServedVersion:
        """The version to serve: the given one, or the highest READY one when ``version`` is ""; NotFound if unknown."""
        entry = self.entry(name)
        if version in ("", None):
            ready = [v for v in entry.versions.values() if v.state == ModelState.READY]
            if ready:
                return max(ready, key=lambda v: v.version)
            if entry.versions:
                return max(entry.versions.values(), key=lambda v: v.version)
            raise Unavailable(f"model '{name}' is not available: {entry.reason or entry.state.value}")
        number = version_number(str(version))  # as version folders are named: '1', not '01', '²' or 4,301 digits
        if number is None or number not in entry.versions:
            have = ", ".join(str(v) for v in sorted(entry.versions)) or "none"
            raise NotFound(f"model '{name}' has no version '{version}' (served versions: {have})")
        return entry.versions[number]

    def serving(self, name: str, version: str = "") -> ServedVersion:
        """The READY version that should run a request, or NotFound / Unavailable saying why not."""
        return check_serving(self.version(name, version))

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Repository index rows: name, version, state, reason.

        As Triton's, it lists every model of the repository, loaded or not: a folder added after the server
        started has a row with no version and no state until it is loaded.
        """
        rows = []
        unseen = () if ready_only else self.unseen()
        for name in sorted([*self._models, *unseen]):
            entry = self._models.get(name)
            if entry is None:
                rows.append({"name": name, "version": "", "state": "",
                             "reason": "not loaded (added to the repository after the server started); load it "
                                       "through the repository API"} if self._scanned else
                            {"name": name, "version": "", "state": ModelState.LOADING.value,
                             "reason": "the server is starting"})
                continue
            if not entry.versions:
                rows.append({"name": name, "version": "", "state": entry.state.value, "reason": entry.reason})
            for v in sorted(entry.versions):
                sv = entry.versions[v]
                reason = sv.reason
                failure = entry.last_failure or entry.reload_failures.get(v, "")
                if not reason and failure and sv.state == ModelState.READY:
                    reason = f"serving the earlier load; the last load failed: {failure}"
                rows.append({"name": name, "version": sv.label, "state": sv.state.value, "reason": reason})
        if ready_only:
            rows = [r for r in rows if r["state"] == ModelState.READY.value]
        return rows

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Scan the repository and load every model (concurrently, each off the event loop)."""
        if not self.repository.is_dir():
            log.warning("model repository %s does not exist; serving no models", self.repository)
            names: list[str] = []
        else:
            entries = [p for p in self.repository.iterdir() if not p.name.startswith(".")]
            # a folder that cannot be looked at (a link into a folder the server may not enter) is a model that
            # fails with its reason; it raised out of the scan, and the server never became ready
            names = sorted(p.name for p in entries if looked_at(p.is_dir, True))
            for p in entries:
                if looked_at(p.is_symlink, False) and not looked_at(p.exists, True):  # meant as a model: say so
                    log.warning("model folder %s is a link to %s, which cannot be followed (missing, or a loop): "
                                "left out", p, os.readlink(p))
        for name in names:
            self._models.setdefault(name, ModelEntry(name, state=ModelState.LOADING))
        self._scanned = True
        self._had_models = any(_NAME.fullmatch(n) for n in names)
        try:
            await asyncio.gather(*(self._load_logged(n) for n in names))
        finally:
            self._started = True
        serving = [e.name for e in self._models.values() if e.state == ModelState.READY]
        self._waiting_for_a_model = self._had_models and not serving
        if not self._had_models:
            log.warning("model repository %s holds no model folder: the server is ready and serves nothing until "
                        "models are added and loaded (POST /v2/repository/models/NAME/load)", self.repository)
        elif not serving:
            # ready by the rule above (nothing loadable is left to wait for), yet it can only refuse: say so loudly
            log.error("no model of %s could be loaded (the errors above say why); the server is not ready until a "
                      "model loads (fix the model folders, then POST /v2/repository/models/NAME/load)",
                      self.repository)

    async def stop(self, drain: bool = True) -> None:
        """Stop every scheduler (running what waits when ``drain``) and release engines."""
        for entry in list(self._models.values()):
            for sv in list(entry.versions.values()):
                await self._retire(sv, drain)

    async def _load_logged(self, name: str) -> None:
        try:
            await self.load(name)
        except RNNServeError as exc:
            log.error("model %s is unavailable: %s", name, exc.message)
            entry = self._models.get(name)
            if entry is not None and entry.state == ModelState.LOADING and not entry.versions:
                # refused before its folder was read (a folder whose name is not a model name): the index says
                # why, and no rnnserve_model_ready series counts it as a model down (lost+found is at the root
                # of every ext4 volume: an alert on == 0 would fire for as long as the server runs)
                entry.state, entry.reason = ModelState.UNAVAILABLE, exc.message

    def _none_ready(self, name: str) -> None:
        """Model ``name`` failed before any version: ``rnnserve_model_ready{version=""}`` 0, so that an alert on
        ``rnnserve_model_ready == 0`` sees a model that never had a version to mark (a bad config.json, no
        version folder); its first ready version removes it."""
        if self.metrics is not None:
            self.metrics.model_ready.labels(model=name, version="").set(0)

    async def _remove(self, entry: ModelEntry, v: int) -> None:
        """Retire version ``v`` and take it out of the model: its row leaves the index, and its series with it."""
        sv = entry.versions[v]
        await self._retire(sv, drain=True)  # listed while it drains: a request meanwhile is told it is unloading
        del entry.versions[v]
        log.info("model %s version %s is no longer served: outside its version policy, or its folder is gone",
                 entry.name, sv.label)
        if self.metrics is not None:
            self.metrics.drop_version(entry.name, sv.label)

    async def load(self, name: str) -> None:
        """(Re)load model ``name`` from the repository per its version policy; raise the load error if any."""
        _check_name(name)
        model_dir = self.repository / name
        if not self._is_folder(name):
            await self._forget_removed(name)
            raise NotFound(f"no model '{name}' in repository {self.repository} (expected folder {model_dir})")
        entry = self._models.setdefault(name, ModelEntry(name))
        async with entry.lock:
            await self._load_locked(entry, model_dir)

    async def forget_removed(self) -> None:
        """Drop what lost its folder: a deleted model's versions that do not serve (failed or unloaded), and the
        model once none remain, so the index lists the repository as it is and such a model's metadata is 404,
        not 503 "not ready". Serving versions keep serving until unloaded; a model being loaded is left to its load."""
        try:
            gone = [n for n in self._models if not self._is_folder(n)]
        except Unavailable:  # an unreadable repository: nothing is known gone, and the index still answers
            return
        for name in gone:
            entry = self._models.get(name)
            if entry is not None and not entry.lock.locked():
                await self._forget_removed(name)

    async def _forget_removed(self, name: str) -> None:
        entry = self._models.get(name)
        if entry is None:
            return
        async with entry.lock:
            for v, sv in list(entry.versions.items()):
                if sv.state not in (ModelState.READY, ModelState.LOADING):
                    await self._remove(entry, v)
            if not entry.versions and self._models.get(name) is entry:
                del self._models[name]
                if self.metrics is not None:  # the model is gone: so are its refusals counted before a version
                    self.metrics.drop_version(name, "")

    async def _load_locked(self, entry: ModelEntry, model_dir: Path) -> None:
        try:
            try:
                config = effective_config(model_dir, self.defaults)
                wanted = self._policy_versions(model_dir, config)
            except PermissionError as exc:  # as a link the server cannot follow: the operator's fix, said as one
                raise InvalidInput(f"model folder {model_dir} cannot be read ({exc.strerror}: {exc.filename}); give "
                                   f"the server's user read and execute permission on it") from None
            except (OSError, ValueError, RecursionError) as exc:  # config.json a folder, unreadable, nested too deep
                raise InvalidInput(f"model folder {model_dir} cannot be read: {type(exc).__name__}: {exc}") from None
        except RNNServeError as exc:
            if not any(v.state == ModelState.READY for v in entry.versions.values()):
                for v in list(entry.versions):
                    await self._remove(entry, v)
                entry.state, entry.reason = ModelState.UNAVAILABLE, exc.message
                self._none_ready(entry.name)
            else:
                entry.last_failure, entry.reload_failures = exc.message, {}
            raise
        entry.last_failure = ""
        entry.reload_failures = {}
        old = dict(entry.versions)
        fresh = {v: ServedVersion(entry.name, v, config=config) for v in wanted}
        for v, sv in fresh.items():
            if v not in old or old[v].state != ModelState.READY:
                # nothing of this version serves (new, unloaded, failed): the index and requests see it LOADING
                entry.versions[v] = sv
        entry.state, entry.reason = ModelState.LOADING, ""
        errors = await asyncio.gather(*(self._load_version(sv, model_dir) for sv in fresh.values()))
        failures = [e for e in errors if e is not None]
        for v, sv in fresh.items():
            previous = old.get(v)
            if sv.state == ModelState.READY or previous is None or previous.state != ModelState.READY:
                entry.versions[v] = sv
            if self.metrics is not None and entry.versions[v].state != ModelState.READY:
                # failed with no earlier copy serving: 0, not absent, so an alert on rnnserve_model_ready == 0
                # sees it (and with --engines N, one process that failed makes the merged series 0)
                self.metrics.model_ready.labels(model=entry.name, version=sv.label).set(0)
        loaded = any(sv.state == ModelState.READY for sv in fresh.values())
        # The new copies serve from now, while the old ones drain: a chunk of an old stream reaching a new copy
        # (the same version's, or, unversioned, the new latest one's) is told why its stream ends, not that it
        # never started; once an old copy has drained, the endings it added meanwhile are passed on too.
        stores = [sv.streams for v, sv in fresh.items() if entry.versions.get(v) is sv and sv.streams is not None]
        for v, previous in old.items():
            if v not in fresh:
                # outside the policy now (or its folder is gone): retired once the new versions serve; a failed
                # reload leaves the versions that served before serving, and unloaded or failed ones go
                if loaded or previous.state != ModelState.READY:
                    _pass_endings(previous, stores, live=True)
                    await self._remove(entry, v)
                    _pass_endings(previous, stores)
            elif entry.versions.get(v) is not previous:
                _pass_endings(previous, stores, live=True)
                await self._retire(previous, drain=True, forget=False)
                _pass_endings(previous, stores)
        ok = any(sv.state == ModelState.READY for sv in entry.versions.values())
        entry.state = ModelState.READY if ok else ModelState.UNAVAILABLE
        entry.reason = "" if ok else "; ".join(e.message for e in failures)
        # versions whose new copy failed while an earlier one serves: the index says so beside those READY rows
        entry.reload_failures = {v: err.message for v, err in zip(fresh, errors)
                                 if err is not None and entry.versions[v] is not fresh[v]}
        if failures:
            raise failures[0]

    def _policy_versions(self, model_dir: Path, config: ModelConfig) -> list[int]:
        present = model_versions(model_dir)
        if not present:
            others = unserved_folders(model_dir)
            seen = f"; its folders hold none: {', '.join(others)}" if others else ""
            raise InvalidInput(f"model folder {model_dir} has no version folder with a model.safetensors "
                               f"(expected {model_dir}/1/model.safetensors){seen}")
        # folders meant as versions (a number in the name: '2' without its file, '02', 'v2'), not docs or notebooks
        others = [o for o in unserved_folders(model_dir)
                  if any(c.isdigit() for c in o.split("'")[1]) and not o.startswith("'.")]
        if others:
            # a newer version copied in halfway (no model.safetensors yet) left the older one serving without a word
            log.warning("model %s: folder(s) %s hold no servable version and are left out (versions with a model: "
                        "%s)", model_dir.name, ", ".join(others), ", ".join(map(str, present)))
        policy = config.version_policy
        if policy == "latest":
            return [present[-1]]
        if policy == "all":
            return present
        missing = sorted(set(policy) - set(present))
        if missing:
            raise InvalidInput(f"version_policy of model '{model_dir.name}' lists versions {missing} that have no "
                               f"folder with a model.safetensors (present: {present})")
        return sorted(set(policy))

    async def _load_version(self, sv: ServedVersion, model_dir: Path) -> RNNServeError | None:
        sv.state, sv.reason = ModelState.LOADING, ""
        start = time.perf_counter()
        try:
            model, engine = await build_off_loop(self._build, model_dir, sv.version, sv.config,
                                                 name=f"load {sv.name} version {sv.version}")
        except Exception as exc:  # noqa: BLE001 - a broken model must not stop the others
            err = exc if isinstance(exc, RNNServeError) else RNNServeError(f"{type(exc).__name__}: {exc}")
            sv.state = ModelState.UNAVAILABLE
            sv.reason = f"failed to load: {err.message}"
            log.error("model %s version %s failed to load: %s", sv.name, sv.version, err.message)
            return type(err)(f"model '{sv.name}' version {sv.version} {sv.reason}")
        cfg = sv.config
        sv.model, sv.engine = model, engine
        sv.budget = MemoryBudget.of(model.spec, cfg.max_batch_memory_mb, engine)
        sv.scheduler = Scheduler(engine, sv.name, sv.label, max_batch_size=cfg.max_batch_size,
                                 max_queue_delay_us=cfg.max_queue_delay_us, max_queue_size=cfg.max_queue_size,
                                 max_batch_steps=sv.budget.max_steps, metrics=self.metrics)
        await sv.scheduler.start()
        sv.streams = StreamStore(sv.name, sv.label, cfg.max_streams, cfg.stream_idle_timeout_s,
                                 # twice max_streams: a stream that ended keeps its slot while its chunks run, so
                                 # a restart meanwhile (or a new stream) finds one; the store holds live streams to
                                 # max_streams (a restart was refused, and its live stream ended all the same)
                                 engine.state_pool(2 * cfg.max_streams), self.metrics, self.stream_expiry_grace_s)
        sv.streams.start()
        sv.state = ModelState.READY
        elapsed = time.perf_counter() - start
        if self.metrics is not None:
            self.metrics.model_load_duration.labels(model=sv.name, version=sv.label).observe(elapsed)
            self.metrics.model_ready.labels(model=sv.name, version=sv.label).set(1)
            with contextlib.suppress(KeyError):  # the model's "no version" series (see _none_ready), if set
                self.metrics.model_ready.remove(sv.name, "")
            self.metrics.model_engine.labels(model=sv.name, version=sv.label, engine=engine.name).set(1)
        # the CPU path decides speed and whether answers are the same to the bit whatever the batch (the
        # compiled kernels) or within ~1e-7 (NumPy): an operator reads which from the log
        kernel = getattr(engine, "cpu_kernel", None)
        log.info("model %s version %s ready on %s engine%s in %.2fs (max_batch_size %d, max_queue_delay_us %d, "
                 "max_batch_memory %d MiB: %d sequence steps)", sv.name, sv.version, engine.name,
                 f", {kernel}," if kernel else "", elapsed,
                 cfg.max_batch_size, cfg.max_queue_delay_us, sv.budget.limit_bytes >> 20, sv.budget.max_steps)
        return None

    def _build(self, model_dir: Path, version: int, config: ModelConfig) -> tuple[PackedModel, Any]:
        model = load_model(model_dir, version)
        model.config = config
        return model, create_engine(model, self.device, blocking_sync=True)

    async def unload(self, name: str) -> None:
        """Drain and unload every version of ``name``; it stays in the index as UNAVAILABLE ("unloaded")."""
        _check_name(name)
        entry = self.entry(name)
        async with entry.lock:
            for sv in list(entry.versions.values()):
                await self._retire(sv, drain=True)
                sv.reason = "unloaded"
            entry.state, entry.reason = ModelState.UNAVAILABLE, "unloaded"
            log.info("model %s unloaded (versions %s)", name, ", ".join(str(v) for v in sorted(entry.versions)) or
                     "none")
        gone = False
        with contextlib.suppress(Unavailable):  # an unreadable repository: the unload is done all the same
            gone = not self._is_folder(name)
        if gone:
            # deleted, then unloaded: gone now, with every series (an alert on rnnserve_model_ready == 0 kept
            # firing, and its metadata said 503 "not ready", until something asked for the index)
            await self._forget_removed(name)

    async def _retire(self, sv: ServedVersion, drain: bool, forget: bool = True) -> None:
        """Stop serving ``sv``; ``forget``: set it not ready and drop its other gauges (not when a reload's new
        copy now owns them)."""
        was_serving = sv.scheduler is not None
        sv.state = ModelState.UNLOADING if was_serving else sv.state
        if not forget:  # the new copy's gauges: this copy's drain and cleared streams must leave them alone
            for part in (sv.scheduler, sv.streams):
                if part is not None:
                    part.release_gauges()
        if sv.scheduler is not None:
            await sv.scheduler.stop(drain)
            sv.scheduler = None
        if sv.streams is not None:
            # The cleared store stays: it tells a late chunk, or a reload's new store, why its stream ended.
            sv.streams.clear(_ended_by_reload(sv))
        if sv.engine is not None:
            try:
                await asyncio.to_thread(sv.engine.close)
            except Exception:  # noqa: BLE001 - a failing close must not block unloading
                log.exception("closing the engine of %s version %s failed", sv.name, sv.version)
            if self.metrics is not None and forget:
                with contextlib.suppress(KeyError):  # never set: the load failed before
                    self.metrics.model_engine.remove(sv.name, sv.label, sv.engine.name)
            sv.engine = None
        if self.metrics is not None and forget:
            self.metrics.forget_model(sv.name, sv.label)
        sv.model = None
        if was_serving:
            sv.state = ModelState.UNAVAILABLE


def _pass_endings(previous: ServedVersion, stores: list[StreamStore], live: bool = False) -> None:
    """Tell a reload's new stream stores why ``previous``'s streams ended (``live``: its live ones too, as ending
    by this reload)."""
    if previous.streams is not None:
        for store in stores:
            store.adopt_endings(previous.streams, live_why=_ended_by_reload(previous) if live else "")


def _ended_by_reload(sv: ServedVersion) -> str:
    """Why a version's streams ended when it was unloaded or a reload replaced it."""
    return f"was ended when model '{sv.name}' version {sv.version} was unloaded or reloaded"
