"""``specdecode validate`` and ``specdecode render``: admission and rendering without a cluster.

Both read every SpecDecodeDeployment in a YAML file (``-`` = stdin) and run the same pure
functions the operator runs: ``validate`` prints what the validating webhook would answer (exit 1
when any resource is refused), ``render`` prints the objects the operator would create, like
``helm template``. Warnings go to stderr as kubectl prints them. Torch-free.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import yaml

from specdecode.operator.render import render
from specdecode.operator.resolve import Resolution, admission_response, admit

EXIT_REFUSED = 1
EXIT_UNREADABLE = 2


class UnreadableFile(ValueError):
    pass


def load_documents(path: str) -> list[dict[str, Any]]:
    """The non-empty YAML documents of ``path`` (``-`` = stdin), each a mapping."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise UnreadableFile(f"{path}: {exc}") from exc
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise UnreadableFile(f"{path}: document {i + 1} is not a mapping")
    if not docs:
        raise UnreadableFile(f"{path}: no documents")
    return docs


def _by_name(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {(d.get("metadata") or {}).get("name", ""): d for d in docs}


def resolutions(path: str, old_path: str | None = None) -> Iterator[Resolution]:
    """Admission's answer per document; with ``old_path``, as an update of the same-named resource."""
    old = _by_name(load_documents(old_path)) if old_path else {}
    for doc in load_documents(path):
        yield admit(doc, old.get((doc.get("metadata") or {}).get("name", "")))


def _warn(resolution: Resolution, err: TextIO) -> None:
    for warning in resolution.warnings:
        print(f"Warning: {warning}", file=err)


def validate(path: str, *, old_path: str | None = None, output: str = "text",
             out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        answers = list(resolutions(path, old_path))
    except UnreadableFile as exc:
        print(f"specdecode validate: {exc}", file=err)
        return EXIT_UNREADABLE
    if output == "json":
        print(json.dumps([admission_response(a) for a in answers], indent=2), file=out)
    else:
        for answer in answers:
            _warn(answer, err)
            print(f'allowed: {answer.name}' if answer.allowed else f"denied: {answer.message}", file=out)
    return 0 if all(a.allowed for a in answers) else EXIT_REFUSED


def render_command(path: str, *, replicas: int | None = None, leader_worker_set: bool = False,
                   out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        answers = list(resolutions(path))
    except UnreadableFile as exc:
        print(f"specdecode render: {exc}", file=err)
        return EXIT_UNREADABLE
    refused = [a for a in answers if not a.allowed]
    for answer in refused:
        print(f"denied: {answer.message}", file=err)
    if refused:
        return EXIT_REFUSED
    objs = []
    for answer in answers:
        _warn(answer, err)
        objs += render(answer.resolved, replicas=replicas, leader_worker_set=leader_worker_set)
    out.write(yaml.safe_dump_all(objs, sort_keys=False, explicit_start=True, allow_unicode=True))
    return 0
