#!/usr/bin/env python3
"""Checks docker/ without a Docker engine (CI also builds and runs the images): each
Dockerfile parses into known instructions, starts with ARG BASE and has one FROM ${BASE} (so a
base made offline can stand in for the public one), runs no RUN or ADD (the offline base has no
shell), copies only what scripts/images.sh stages for it (bin/<its workspace binary>, and cuda/
for the worker, the wheels scripts/test-tools.sh pins), runs that binary, and ends as a numeric
non-root USER.
Usage: scripts/check-docker.py [REPO]; exit status 1 names each problem."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}


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


def staged(repo: Path) -> dict[str, str]:
    """What scripts/images.sh copies into each image's context as bin/: image -> binary."""
    text = (repo / "scripts/images.sh").read_text()
    found = re.search(r"local -A binary=\(([^)]*)\)", text)
    return dict(re.findall(r"\[([\w-]+)\]=([\w-]+)", found.group(1))) if found else {}


def check(repo: Path) -> list[str]:
    problems = []
    packages = binaries(repo)
    workspace_binaries = set().union(*packages.values()) if packages else set()
    binary_of = staged(repo)
    if not binary_of:
        problems.append("scripts/images.sh: no `local -A binary=(...)` map of image to binary")
    dockerfiles = sorted((repo / "docker").glob("*.Dockerfile"))
    if not dockerfiles:
        problems.append("docker/ holds no *.Dockerfile")
    for dockerfile in dockerfiles:
        where = dockerfile.relative_to(repo)
        image = dockerfile.name.removesuffix(".Dockerfile")
        steps = instructions(dockerfile.read_text())
        if image not in binary_of:
            problems.append(f"{where}: scripts/images.sh builds no image {image} (its binary map lacks it)")
        if not steps or steps[0][1] != "ARG" or not steps[0][2].startswith("BASE="):
            problems.append(f"{where}: the first instruction is not ARG BASE=<the public base a user pulls>")
        froms = [args for _, keyword, args in steps if keyword == "FROM"]
        if froms != ["${BASE}"]:
            problems.append(f"{where}: has FROM {froms}, not one FROM ${{BASE}} (a base made offline must do)")
        users = [args for _, keyword, args in steps if keyword == "USER"]
        uid = users[-1].split(":")[0] if users else ""
        if not uid.isdigit() or uid == "0":
            who = uid or "the base image's user"
            problems.append(f"{where}: runs as {who}: end with USER 65532:65532 (numeric, not root)")
        copied: set[str] = set()
        for line, keyword, args in steps:
            if keyword not in INSTRUCTIONS:
                problems.append(f"{where}:{line}: unknown instruction {keyword}")
            if keyword in ("RUN", "ADD"):
                problems.append(f"{where}:{line}: {keyword} needs a shell or the network at build time, which the offline base has not: stage the file with scripts/images.sh and COPY it")
            if keyword == "COPY":
                words = [w for w in args.split() if not w.startswith("--")]
                if any(w.startswith("--from") for w in args.split()):
                    problems.append(f"{where}:{line}: COPY --from needs a build stage: scripts/images.sh stages what the image holds")
                for source in words[:-1]:
                    source = source.rstrip("/")
                    if source == "cuda" and image == "harvester":
                        continue
                    binary = source.removeprefix("bin/")
                    if not source.startswith("bin/") or binary not in workspace_binaries:
                        problems.append(f"{where}:{line}: COPY {source}: the context holds bin/<a workspace binary> (and cuda/ for the worker), nothing else")
                    elif binary_of.get(image) != binary:
                        problems.append(f"{where}:{line}: COPY {source}, but scripts/images.sh stages bin/{binary_of.get(image)} for {image}")
                    copied.add(binary)
        entry = [args for _, keyword, args in steps if keyword == "ENTRYPOINT"]
        target = json.loads(entry[-1])[0] if entry else ""
        if Path(target).name not in copied:
            problems.append(f"{where}: ENTRYPOINT {target or 'missing'} is not a binary it copies")
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
