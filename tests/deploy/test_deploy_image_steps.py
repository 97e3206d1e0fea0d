"""Run the image's own install and start steps, read from the Dockerfile, in a fresh virtualenv.

CI cannot run Docker, so this test replays what `docker build` and `docker run` would do:

* build stage: every RUN of the builder stage except system package management
  (apt-get), i.e. the venv creation, the wheel build, the pip install and the
  `rnnserve --version` smoke check, plus its COPYs from the repository, with its ENV;
* final stage: its ENV and WORKDIR, ENTRYPOINT + CMD, HEALTHCHECK and STOPSIGNAL.

Substitutions, and why:

* Container paths (/opt/venv, /src, /wheels, /models, /) live under a temp "root".
* `python3` (Ubuntu 24.04's 3.12 in the image) is the interpreter running the tests;
  the venv is a plain `python -m venv` (no --system-site-packages).
* pip runs offline: PIP_NO_INDEX=1 and PIP_FIND_LINKS point at a wheelhouse repacked
  from the distributions installed in this test environment (the dependency closure
  of pyproject's [project].dependencies and build-system.requires). pip still resolves
  every declared dependency from pyproject, so an undeclared import fails the start.
* The `[gpu]` extra (cupy-cuda13x, nvidia-cudnn-cu13: ~1 GB of CUDA wheels) is dropped;
  `--device auto` then serves on the CPU reference engine, which is what the image
  does on a host without a GPU.
* /models holds a tiny LSTM written by the test instead of ./models, and the server
  gets `--http-port 0 --grpc-port 0 --host 127.0.0.1` appended (free ports, loopback).
"""
from __future__ import annotations

import hashlib
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import zipfile
from base64 import urlsafe_b64encode
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from dockerfile_model import Dockerfile, Stage, healthcheck_command, parse_dockerfile
from live_server import bound_ports, clean_env, infer_and_check, running, wait_ready, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_DIRS = {"usr", "bin", "sbin", "lib", "lib64", "etc", "var", "tmp", "dev", "proc", "sys", "run", "home", "root"}
SKIPPED_COMMANDS = ("apt-get", "apt ", "groupadd", "useradd", "rm -rf /var/lib/apt")

pytestmark = pytest.mark.slow


# --- wheelhouse: the installed dependency closure, repacked as wheels -------------------------------

def _requirement_closure(roots: list[str]) -> dict[str, metadata.Distribution]:
    found: dict[str, metadata.Distribution] = {}
    todo = [(Requirement(r), "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        dist = found.get(name) or metadata.distribution(name)
        if name not in found:
            found[name] = dist
            todo += [(Requirement(r), "") for r in dist.requires or []]
        for ex in req.extras:
            todo += [(Requirement(r), ex) for r in dist.requires or [] if "extra" in r]
    return found


def _record_hash(data: bytes) -> str:
    return "sha256=" + urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _repack(dist: metadata.Distribution, outdir: Path) -> Path:
    """Write an installed distribution back into a wheel (its site-packages files and dist-info)."""
    tags = [ln.split(":", 1)[1].strip() for ln in (dist.read_text("WHEEL") or "").splitlines() if ln.startswith("Tag:")]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    wheel = outdir / f"{name}-{dist.version}-{tags[0] if tags else 'py3-none-any'}.whl"
    if wheel.exists():
        return wheel
    files = [f for f in dist.files or [] if ".." not in f.parts and "__pycache__" not in f.parts]
    info_dirs = {f.parts[0] for f in files if f.parts[0].endswith(".dist-info")}
    assert len(info_dirs) == 1, f"{dist.metadata['Name']}: expected one .dist-info, got {info_dirs}"
    (info_dir,) = info_dirs
    tmp = wheel.with_suffix(".part")
    record = []
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
        for f in files:
            rel = f.as_posix()
            if f.parts[0] == info_dir and f.name in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
                continue
            data = Path(dist.locate_file(f)).read_bytes()
            zf.writestr(rel, data)
            record.append(f"{rel},{_record_hash(data)},{len(data)}")
        record.append(f"{info_dir}/RECORD,,")
        zf.writestr(f"{info_dir}/RECORD", "\n".join(record) + "\n")
    tmp.rename(wheel)
    return wheel


@pytest.fixture(scope="module")
def wheelhouse(request, tmp_path_factory) -> Path:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    roots = pyproject["project"]["dependencies"] + pyproject["build-system"]["requires"]
    # Wheels are cached between runs in pytest's cache dir when there is one; pip sees
    # links to exactly the installed versions' wheels.
    cache = getattr(request.config, "cache", None)
    store = Path(cache.mkdir("rnnserve-deploy-wheelhouse")) if cache else tmp_path_factory.mktemp("wheel-store")
    house = tmp_path_factory.mktemp("wheelhouse")
    for dist in _requirement_closure(roots).values():
        wheel = _repack(dist, store)
        (house / wheel.name).symlink_to(wheel)
    return house


# --- replaying the Dockerfile ---------------------------------------------------------------------

class Sandbox:
    """Maps the image's absolute paths under a temp root and runs the Dockerfile's commands there."""

    def __init__(self, root: Path, dockerfile: Dockerfile):
        self.root = root
        self.dockerfile = dockerfile
        # The image's own directories: where it puts things (WORKDIR, COPY/VOLUME targets,
        # ENV values) and the absolute paths its RUN, ENTRYPOINT and CMD name. URLs
        # (http://host:port/v2/...) are not paths.
        places = []
        for ins in (i for s in dockerfile.stages for i in s.instructions):
            if ins.keyword in ("WORKDIR", "COPY", "VOLUME", "ENV", "RUN", "ENTRYPOINT", "CMD"):
                places += re.findall(r"(?<![\w$.:/}-])/([A-Za-z0-9_.-]+)", ins.value)
        tops = set(places) - SYSTEM_DIRS
        self._pattern = re.compile(r"(?<![\w$.:/}-])/(" + "|".join(map(re.escape, sorted(tops))) + r")(?=[/\s\"':]|$)")

    def path(self, container_path: str) -> Path:
        return self.root / container_path.lstrip("/")

    def rewrite(self, text: str) -> str:
        return self._pattern.sub(lambda m: f"{self.root}/{m.group(1)}", text)

    def env(self, stage: Stage, **extra: str) -> dict[str, str]:
        env = clean_env(**extra)
        for key, value in stage.env().items():
            value = value.replace("$PATH", env.get("PATH", "")).replace("${PATH}", env.get("PATH", ""))
            env[key] = self.rewrite(value)
        return env

    def copy(self, stage: Stage, source_root: Path) -> None:
        workdir = "/"
        for ins in stage.instructions:
            if ins.keyword == "WORKDIR":
                workdir = ins.value.strip()
                self.path(workdir).mkdir(parents=True, exist_ok=True)
            if ins.keyword != "COPY" or "--from=" in ins.value:
                continue
            *sources, dest = [t for t in ins.value.split() if not t.startswith("--")]
            dest_path = self.path(dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}")
            for src in sources:
                src_path = source_root / src
                if src_path.is_dir():
                    shutil.copytree(src_path, dest_path if dest.endswith("/") or len(sources) == 1 else dest_path / src_path.name,
                                    dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    dest_path.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src_path, dest_path / src_path.name)

    def run_build_steps(self, stage: Stage, env: dict[str, str], log: Path) -> list[str]:
        ran = []
        workdir = "/"
        for ins in stage.instructions:
            if ins.keyword == "WORKDIR":
                workdir = ins.value.strip()
            if ins.keyword != "RUN" or ins.value.lstrip().startswith(SKIPPED_COMMANDS):
                continue
            command = self.rewrite(ins.value)
            command = re.sub(r"\bpython3(?= -m venv)", sys.executable, command)
            command = command.replace("[gpu]", "")  # no CUDA wheels offline; see the module docstring
            with open(log, "a") as out:
                out.write(f"\n$ {command}\n")
                out.flush()
                proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=self.path(workdir), env=env,
                                      stdout=out, stderr=subprocess.STDOUT, timeout=300)
            assert proc.returncode == 0, f"Dockerfile line {ins.line} failed: {command}\n{log.read_text()[-4000:]}"
            ran.append(command)
        return ran


def test_image_install_and_start_steps(tmp_path, wheelhouse):
    dockerfile = parse_dockerfile(ROOT / "Dockerfile")
    builder, final = dockerfile.stage("builder"), dockerfile.final
    box = Sandbox(tmp_path / "root", dockerfile)
    log = tmp_path / "build.log"

    # docker build: builder stage
    box.copy(builder, ROOT)
    build_env = box.env(builder, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse), PIP_NO_CACHE_DIR="1",
                        PIP_DISABLE_PIP_VERSION_CHECK="1")
    ran = box.run_build_steps(builder, build_env, log)
    assert any(" -m venv " in c for c in ran), "the builder stage creates no virtualenv"
    assert any("pip install" in c for c in ran), "the builder stage runs no pip install"

    # docker build: final stage (the venv is COPY --from=builder at the same path; /models is ours)
    write_tiny_model(box.path("/models"))
    env = box.env(final)
    venv_python = shutil.which("python3", path=env["PATH"])
    assert venv_python and Path(venv_python).is_relative_to(box.root), "python3 must come from the image's venv"
    probe = subprocess.run([venv_python, "-c", "import pytest"], capture_output=True, env=env, timeout=60)
    assert probe.returncode != 0, "test dependencies leaked into the image's virtualenv"

    # docker run IMAGE convert --help: the ENTRYPOINT takes every subcommand
    entrypoint = [box.rewrite(a) for a in final.last("ENTRYPOINT").exec_form()]
    cmd = [box.rewrite(a) for a in final.last("CMD").exec_form()]
    executable = shutil.which(entrypoint[0], path=env["PATH"])
    assert executable and Path(executable).is_relative_to(box.root), f"{entrypoint[0]} is not installed in the venv"
    workdir = box.path(final.workdir())
    convert = subprocess.run([executable, *entrypoint[1:], "convert", "--help"], capture_output=True, text=True,
                             env=env, cwd=workdir, timeout=60)
    assert convert.returncode == 0, convert.stdout + convert.stderr

    # docker run IMAGE: ENTRYPOINT + CMD, on free loopback ports
    server_log = tmp_path / "server.log"
    argv = [executable, *entrypoint[1:], *cmd, "--http-port", "0", "--grpc-port", "0", "--host", "127.0.0.1"]
    with running(argv, server_log, env=env, cwd=workdir) as server:
        http_port, _ = bound_ports(server, server_log, timeout=90)
        wait_ready(server, http_port, server_log, timeout=90)
        infer_and_check(http_port, box.path("/models"))

        health = [box.rewrite(a) for a in healthcheck_command(final)]
        probe = subprocess.run(health, capture_output=True, text=True, env={**env, "RNNSERVE_HTTP_PORT": str(http_port)},
                               cwd=workdir, timeout=30)
        assert probe.returncode == 0, f"HEALTHCHECK failed: {probe.stdout}{probe.stderr}"

        # docker stop: STOPSIGNAL, then the server drains and exits 0
        server.send_signal(getattr(signal, final.last("STOPSIGNAL").value))
        assert server.wait(30) == 0, server_log.read_text()[-3000:]
