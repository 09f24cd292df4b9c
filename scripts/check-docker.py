#!/usr/bin/env python3
"""Checks docker/ as far as a machine without a Docker engine can: each Dockerfile parses into
known instructions, every COPY source exists in the build context and is not left out by
.dockerignore, .dockerignore leaves out target/ and .git/, every binary an image copies out of
its build stage is a binary target of the package that stage builds (so the image runs what CI
built and tested), every folder copied out of another stage is one that stage's pip installs
into, and the NVIDIA wheels an image installs are the versions scripts/test-tools.sh pins (the
CUDA libraries CI compiled the kernels with and resolved every entry point in).
Usage: scripts/check-docker.py [REPO]; exit status 1 names each problem."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from pathlib import Path

INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}
MUST_IGNORE = ("target", ".git")


def instructions(text: str) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments), with continuation lines joined and comments dropped."""
    out, pending, start = [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = (pending + stripped).strip()
        pending = ""
        keyword, _, rest = whole.partition(" ")
        out.append((start, keyword.upper(), rest.strip()))
    return out


def ignored(patterns: list[str], path: str) -> bool:
    """Whether .dockerignore's patterns leave `path` (relative, with /) out, `!` lines included."""
    left_out = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        hit = any(
            fnmatch.fnmatch("/".join(parts[: i + 1]), pattern)
            or fnmatch.fnmatch("/".join(parts[: i + 1]), pattern.replace("**/", ""))
            for i in range(len(parts))
        )
        if hit:
            left_out = not negate
    return left_out


def binaries(repo: Path) -> dict[str, set[str]]:
    """Each workspace package's binary targets."""
    metadata = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--no-deps", "--format-version", "1", "--offline"],
            cwd=repo, check=True, capture_output=True, text=True,
        ).stdout
    )
    return {
        p["name"]: {t["name"] for t in p["targets"] if "bin" in t["kind"]}
        for p in metadata["packages"]
    }


def check(repo: Path) -> list[str]:
    problems = []
    ignore_file = repo / ".dockerignore"
    patterns = [
        line.strip() for line in ignore_file.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ] if ignore_file.exists() else []
    for name in MUST_IGNORE:
        if not ignored(patterns, name):
            problems.append(f".dockerignore does not leave out {name}/: add a line {name}/")
    packages = binaries(repo)
    wheels: dict[str, set[tuple[str, str]]] = {}
    dockerfiles = sorted((repo / "docker").glob("*.Dockerfile"))
    if not dockerfiles:
        problems.append("docker/ holds no *.Dockerfile")
    for dockerfile in dockerfiles:
        where = dockerfile.relative_to(repo)
        steps = instructions(dockerfile.read_text())
        # Per stage (by its AS name): the binaries its cargo builds, the folders pip fills.
        stage = ""
        built_in: dict[str, set[str]] = {}
        pip_targets: dict[str, set[str]] = {}
        built: set[str] = set()
        if not steps or steps[0][1] not in ("FROM", "ARG"):
            problems.append(f"{where}: the first instruction is not FROM")
        for line, keyword, args in steps:
            if keyword not in INSTRUCTIONS:
                problems.append(f"{where}:{line}: unknown instruction {keyword}")
            if keyword == "FROM":
                named = re.search(r"\s+AS\s+([\w.-]+)\s*$", args, re.IGNORECASE)
                stage = named.group(1) if named else ""
            if keyword == "RUN":
                for package in re.findall(r"cargo build [^&;]*?-p ([\w-]+)", args):
                    if package not in packages:
                        problems.append(f"{where}:{line}: cargo builds -p {package}, which is not a workspace package")
                    built |= packages.get(package, set())
                    built_in.setdefault(stage, set()).update(packages.get(package, set()))
                for target in re.findall(r"pip install [^&;]*?--target[= ](\S+)", args):
                    pip_targets.setdefault(stage, set()).add(target)
                for pin in re.findall(r"(nvidia-[\w-]+)==([\w.]+)", args):
                    wheels.setdefault(pin[0], set()).add((pin[1], f"{where}:{line}"))
            if keyword == "COPY":
                words = [w for w in args.split() if not w.startswith("--")]
                sources = words[:-1]
                source_stage = re.search(r"--from=([\w.-]+)", args)
                if source_stage and source_stage.group(1) in pip_targets:
                    for source in sources:
                        if source.rstrip("/") not in pip_targets[source_stage.group(1)]:
                            problems.append(
                                f"{where}:{line}: copies {source} from stage {source_stage.group(1)}, whose pip installs into {', '.join(sorted(pip_targets[source_stage.group(1)]))}"
                            )
                    continue
                if "--from=" in args:
                    for source in sources:
                        binary = Path(source).name
                        if binary not in built:
                            problems.append(
                                f"{where}:{line}: copies {source}, not a binary the build stage's cargo build makes ({', '.join(sorted(built)) or 'none'})"
                            )
                    continue
                for source in sources:
                    relative = source.rstrip("/")
                    if relative == ".":
                        continue
                    if not (repo / relative).exists():
                        problems.append(f"{where}:{line}: COPY source {source} does not exist in the context")
                    elif ignored(patterns, relative):
                        problems.append(f"{where}:{line}: COPY source {source} is left out by .dockerignore")
    tested = dict(re.findall(r"(nvidia-[\w-]+)==([\w.]+)", (repo / "scripts/test-tools.sh").read_text()))
    for wheel, uses in sorted(wheels.items()):
        for version, place in sorted(uses):
            if tested.get(wheel) != version:
                problems.append(
                    f"{place}: installs {wheel}=={version}, but CI tests {wheel}=={tested.get(wheel, 'nothing')} (scripts/test-tools.sh): pin the same version"
                )
    return problems


def main() -> int:
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    problems = check(repo)
    for problem in problems:
        print(problem, file=sys.stderr)
    count = len(list((repo / "docker").glob("*.Dockerfile")))
    print(f"docker: {count} Dockerfiles, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
