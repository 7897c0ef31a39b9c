"""store: a local SpecDecodeDeployment's state on disk — what ``kubectl`` and etcd hold for the
operator, ``specdecode up`` and its commands share through files.

``root/NAME/``:

- ``resource.json``: the resource as applied (metadata with annotations and ``generation``, spec);
  ``apply`` bumps the generation when the spec changes, the commands set annotations;
- ``status.json``: ``.status``, written by the loop;
- ``events.jsonl``: Events, one JSON object a line (time, type, reason, message);
- ``revisions/REV.json``: the argv each revision's replicas run (a revision no longer rendered
  is still scaled, so its command line is kept as a Kubernetes workload keeps its template);
- the supervisor's pid file, lock and logs.

Writes go through a temporary file and ``os.replace``; read-modify-write under ``flock``, so a
command and the loop never lose each other's change.
"""
from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specdecode.operator.reconcile import read_status
from specdecode.operator.rollout import Event
from specdecode.operator.spec import SpecDecodeDeploymentStatus

Obj = dict[str, Any]
ENV_STATE_DIR = "SPECDECODE_STATE_DIR"


def default_root() -> Path:
    """``$SPECDECODE_STATE_DIR``, else ``$XDG_STATE_HOME/specdecode``, else ``~/.local/state/specdecode``."""
    if os.environ.get(ENV_STATE_DIR):
        return Path(os.environ[ENV_STATE_DIR])
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "specdecode"


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class Store:
    def __init__(self, root: Path, name: str) -> None:
        self.name, self.dir = name, root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "revisions").mkdir(exist_ok=True)

    @classmethod
    def existing(cls, root: Path, name: str) -> Store:
        """The store of a deployment ``up`` ran; FileNotFoundError (creating nothing) if none did."""
        if not (root / name / "resource.json").exists():
            raise FileNotFoundError(f"{name}: no such deployment in {root} (start it with `specdecode up FILE`)")
        return cls(root, name)

    @property
    def resource_path(self) -> Path:
        return self.dir / "resource.json"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.dir / "resource.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def resource(self) -> Obj | None:
        try:
            return json.loads(self.resource_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None

    def apply(self, body: Mapping[str, Any]) -> bool:
        """Store ``body`` as the resource (its annotations merged over the stored ones); whether
        its spec changed (the generation moved)."""
        with self._locked():
            old = self.resource() or {"metadata": {"generation": 0}}
            meta = dict(old["metadata"])
            changed = old.get("spec") != body.get("spec")
            meta["generation"] = meta.get("generation", 0) + int(changed)
            meta["name"] = self.name
            meta["annotations"] = {**meta.get("annotations", {}), **(body.get("metadata", {}).get("annotations") or {})}
            _write_json(self.resource_path, {**body, "metadata": meta})
            return changed

    def set_annotation(self, key: str, value: str) -> None:
        self._edit_annotations(lambda annotations: annotations | {key: value})

    def remove_annotations(self, keys: Sequence[str]) -> None:
        if keys:
            self._edit_annotations(lambda annotations: {k: v for k, v in annotations.items() if k not in keys})

    def _edit_annotations(self, edit: Any) -> None:
        with self._locked():
            body = self.resource()
            if body is None:
                raise FileNotFoundError(f"{self.name}: no such deployment (run `specdecode up FILE` first)")
            body["metadata"]["annotations"] = edit(body["metadata"].get("annotations") or {})
            _write_json(self.resource_path, body)

    def status(self) -> SpecDecodeDeploymentStatus:
        try:
            return read_status({"status": json.loads((self.dir / "status.json").read_text(encoding="utf-8"))})
        except FileNotFoundError:
            return SpecDecodeDeploymentStatus()

    def write_status(self, status: SpecDecodeDeploymentStatus) -> None:
        _write_json(self.dir / "status.json", status.model_dump(mode="json", by_alias=True, exclude_none=True))

    def append_events(self, events: Sequence[Event]) -> None:
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        with open(self.dir / "events.jsonl", "a", encoding="utf-8") as log:
            for event in events:
                log.write(json.dumps({"time": now, "type": event.type.value, "reason": event.reason,
                                      "message": event.message}) + "\n")

    def events(self, offset: int = 0) -> tuple[list[Obj], int]:
        """The Events logged from byte ``offset`` on, and the offset after them (a reader that keeps
        it reads each Event once)."""
        try:
            with open(self.dir / "events.jsonl", "rb") as log:
                log.seek(offset)
                data = log.read()
        except FileNotFoundError:
            return [], offset
        complete = data[:data.rfind(b"\n") + 1]  # a line being written waits for the next read
        return [json.loads(line) for line in complete.splitlines() if line.strip()], offset + len(complete)

    def argv(self, revision: str) -> list[str] | None:
        try:
            return json.loads((self.dir / "revisions" / f"{revision}.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None

    def keep_argv(self, revision: str, argv: Sequence[str]) -> None:
        _write_json(self.dir / "revisions" / f"{revision}.json", list(argv))
