"""A small Dockerfile reader for the deploy tests: stages, instructions, exec-form arguments.

It understands what our Dockerfile uses (parser directives, comments, backslash
continuations, ARG before FROM, ``FROM image AS name``, JSON and shell forms), so the
tests read the real Dockerfile instead of a copy of its commands.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str  # upper case: RUN, COPY, ...
    value: str    # the arguments, continuations joined, comments dropped
    line: int     # first line in the file

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction (CMD, ENTRYPOINT, ...), else None."""
        text = self.value.strip()
        if not text.startswith("["):
            return None
        return json.loads(text)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None

    def env(self) -> dict[str, str]:
        """ENV settings of this stage (``KEY=VALUE`` forms), in order; ``$VAR`` left unexpanded."""
        out: dict[str, str] = {}
        for ins in self.all("ENV"):
            for token in shlex.split(ins.value):
                if "=" in token:
                    key, val = token.split("=", 1)
                    out[key] = val
        return out

    def workdir(self, default: str = "/") -> str:
        w = self.last("WORKDIR")
        return w.value.strip() if w else default


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"{self.path} has no stage named {name!r}")


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join continuation lines; drop comments and blank lines (comments inside a RUN too)."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf.append(stripped[:-1].rstrip())
            continue
        buf.append(stripped)
        out.append((start, " ".join(p for p in buf if p)))
        buf = []
    if buf:
        out.append((start, " ".join(buf)))
    return out


def _expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def parse_dockerfile(path: str | Path) -> Dockerfile:
    path = Path(path)
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, text in _logical_lines(path.read_text()):
        keyword, _, value = text.partition(" ")
        keyword = keyword.upper()
        value = value.strip()
        if keyword == "ARG" and not stages:
            name, _, default = value.partition("=")
            global_args[name] = default
            continue
        if keyword == "FROM":
            parts = value.split()
            flags = [p for p in parts if p.startswith("--")]
            parts = [p for p in parts if not p.startswith("--")]
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stage = Stage(base=_expand(parts[0], global_args), name=name)
            stage.instructions.append(Instruction("FROM", " ".join(flags + parts), line))
            stages.append(stage)
            continue
        if not stages:
            raise ValueError(f"{path}:{line}: {keyword} before the first FROM")
        stages[-1].instructions.append(Instruction(keyword, value, line))
    return Dockerfile(path, global_args, stages)


def healthcheck_command(stage: Stage) -> list[str] | None:
    """The exec-form command of the stage's HEALTHCHECK (None if absent or NONE)."""
    hc = stage.last("HEALTHCHECK")
    if hc is None:
        return None
    _, sep, rest = hc.value.partition("CMD ")
    if not sep:
        return None
    rest = rest.strip()
    return json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]


def read_dockerignore(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.exists():
        return []
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.strip().startswith("#")]
