"""Field ownership as the API server keeps it in ``metadata.managedFields``, and server-side apply,
for the emulator (kube_emulator.py).

A *field set* is a set of paths in the FieldsV1 spelling a real server writes: ``("f:spec",
"f:replicas")`` is a field; an item of an associative list is ``k:{"name":"runtime"}`` (its
keys as compact, sorted JSON) and owning the item itself is the path ending in ``"."``. A
non-empty map is never owned itself, only what is in it; a scalar, an atomic list or an empty
map is a leaf.

What the real server reads from each type's OpenAPI schema (which lists are associative, by
which keys) is the table ``LIST_KEYS`` here, by field name, for the fields the operator renders;
every other list is atomic (replaced whole). Sets (``finalizers``) count as atomic lists.

- ``updated``: a create, merge patch or JSON patch by ``manager`` (operation ``Update``): the
  fields it changed become that manager's and leave every other manager; fields that are gone
  leave everyone. A request that writes ``managedFields`` itself is taken as written.
- ``apply``: server-side apply by ``manager``: fields another manager owns with a different
  value conflict (409 unless forced; forcing takes them over), fields the manager applied before
  and applies no more are removed unless another manager owns them too, then the configuration
  is merged in (maps by key, associative lists by item, everything else replaced) and the
  manager's ``Apply`` entry is exactly the configuration's field set.

Not modelled: ``status`` (subresource entries), unions, defaulting, and field types the table
does not name.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

Obj = dict[str, Any]
Path = tuple[str, ...]
MISSING = object()
UPDATE, APPLY = "Update", "Apply"
ITEM = "."  # the path element for owning a list item itself

# Associative lists of the objects the operator renders, by field name: the keys of their items.
LIST_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",), "initContainers": ("name",), "env": ("name",), "volumes": ("name",),
    "volumeMounts": ("mountPath",), "imagePullSecrets": ("name",), "ownerReferences": ("uid",),
    "topologySpreadConstraints": ("topologyKey", "whenUnsatisfiable"),
}
# Fields no manager owns: identity and bookkeeping the server keeps itself.
UNOWNED_TOP = frozenset({"apiVersion", "kind", "status"})
UNOWNED_META = frozenset({"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                          "managedFields", "selfLink", "deletionTimestamp", "deletionGracePeriodSeconds"})


class Conflict(Exception):
    """Fields an apply would change that other managers own."""

    def __init__(self, conflicts: Iterable[tuple[str, Path]]) -> None:
        self.conflicts = sorted(conflicts)
        described = "; ".join(f'conflict with "{m}": ' + "".join(f".{e[2:]}" if e.startswith("f:") else f"[{e[2:]}]"
                                                                 for e in p) for m, p in self.conflicts)
        super().__init__(f"Apply failed with {len(self.conflicts)} conflict(s): {described}")


def _item_keys(field: str, item: Any) -> tuple[str, ...] | None:
    if not isinstance(item, Mapping):
        return None
    if field == "ports":  # a container's ports and a Service's, by the schemas' listMapKeys
        return ("containerPort", "protocol") if "containerPort" in item else ("port", "protocol")
    return LIST_KEYS.get(field)


def _item_element(field: str, item: Mapping[str, Any]) -> str:
    keys = _item_keys(field, item) or ()
    return "k:" + json.dumps({k: item.get(k) for k in keys}, sort_keys=True, separators=(",", ":"))


def _keyed(field: str, value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_item_keys(field, i) for i in value)


# -- field sets ---------------------------------------------------------------------------------


def fields(obj: Mapping[str, Any] | None) -> frozenset[Path]:
    """The field set of an object or an apply configuration."""
    if not obj:
        return frozenset()
    out: set[Path] = set()
    for key, value in obj.items():
        if key in UNOWNED_TOP:
            continue
        if key == "metadata" and isinstance(value, Mapping):
            for meta_key, meta_value in value.items():
                if meta_key not in UNOWNED_META:
                    out.update(_walk(meta_key, meta_value, ("f:metadata", f"f:{meta_key}")))
        else:
            out.update(_walk(key, value, (f"f:{key}",)))
    return frozenset(out)


def _walk(field: str, value: Any, prefix: Path) -> Iterator[Path]:
    if isinstance(value, Mapping) and value:
        for key, inner in value.items():
            yield from _walk(key, inner, (*prefix, f"f:{key}"))
    elif _keyed(field, value):
        for item in value:
            at = (*prefix, _item_element(field, item))
            yield (*at, ITEM)
            for key, inner in item.items():
                yield from _walk(key, inner, (*at, f"f:{key}"))
    else:
        yield prefix


def to_v1(paths: Iterable[Path]) -> Obj:
    tree: Obj = {}
    for path in paths:
        node = tree
        for part in path:
            node = node.setdefault(part, {})
    return tree


def from_v1(tree: Mapping[str, Any], prefix: Path = ()) -> frozenset[Path]:
    if not tree:
        return frozenset({prefix}) if prefix else frozenset()
    return frozenset(p for part, inner in tree.items() for p in from_v1(inner, (*prefix, part)))


def value_at(obj: Any, path: Path) -> Any:
    node = obj
    for part in path:
        if part == ITEM:
            return node
        node = _child(node, part)
        if node is MISSING:
            return MISSING
    return node


def _child(node: Any, part: str) -> Any:
    if part.startswith("f:"):
        return node.get(part[2:], MISSING) if isinstance(node, Mapping) else MISSING
    if part.startswith("k:") and isinstance(node, list):
        wanted = json.loads(part[2:])
        return next((i for i in node if isinstance(i, Mapping) and all(i.get(k) == v for k, v in wanted.items())),
                    MISSING)
    return MISSING


def _remove(obj: Obj, path: Path) -> None:
    """Remove the field (or list item) at ``path``; maps and lists left empty by it go too, as
    the API's ``omitempty`` fields do."""
    where = path[:-2] if path[-1] == ITEM else path[:-1]
    container = value_at(obj, where)
    if path[-1] == ITEM:
        target = _child(container, path[-2])
        if isinstance(container, list) and target is not MISSING:
            container.remove(target)
    elif isinstance(container, dict):
        container.pop(path[-1][2:], None)
    for depth in range(len(where), 0, -1):
        parent, node = value_at(obj, where[:depth - 1]), value_at(obj, where[:depth])
        if node not in ({}, []) or not isinstance(parent, dict) or not where[depth - 1].startswith("f:"):
            break
        parent.pop(where[depth - 1][2:])


def _merged(live: Any, config: Any, field: str = "") -> Any:
    if isinstance(live, Mapping) and isinstance(config, Mapping):
        out = dict(live)
        for key, value in config.items():
            out[key] = _merged(live.get(key), value, key)
        return out
    if _keyed(field, config) and isinstance(live, list) and all(_item_keys(field, i) for i in live):
        out_list = list(live)
        for item in config:
            element = _item_element(field, item)
            index = next((n for n, i in enumerate(out_list) if _item_element(field, i) == element), None)
            if index is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[index] = _merged(out_list[index], item)
        return out_list
    return copy.deepcopy(config)


# -- managedFields --------------------------------------------------------------------------------


def _entries(obj: Mapping[str, Any] | None) -> list[Obj]:
    return list(((obj or {}).get("metadata") or {}).get("managedFields") or [])


def _entry(manager: str, operation: str, api_version: str, paths: Iterable[Path], now: str) -> Obj:
    return {"manager": manager, "operation": operation, "apiVersion": api_version, "time": now,
            "fieldsType": "FieldsV1", "fieldsV1": to_v1(paths)}


def _owned(entry: Mapping[str, Any]) -> frozenset[Path]:
    return from_v1(entry.get("fieldsV1") or {})


def _is(entry: Mapping[str, Any], manager: str, operation: str) -> bool:
    return entry.get("manager") == manager and entry.get("operation") == operation and not entry.get("subresource")


def updated(before: Obj | None, after: Obj, manager: str, now: str) -> list[Obj]:
    """``after``'s managedFields once ``manager`` wrote it (a create when ``before`` is None)."""
    if before is not None and _entries(after) != _entries(before):
        return _entries(after)  # the request set managedFields itself (e.g. a migration): as written
    now_fields = fields(after)
    changed = {p for p in now_fields if value_at(before or {}, p) is MISSING
               or (p[-1] != ITEM and value_at(before or {}, p) != value_at(after, p))}
    out, mine = [], set(changed)
    for entry in _entries(before):
        kept = (_owned(entry) - changed) & now_fields
        if _is(entry, manager, UPDATE):
            mine |= kept
        elif kept:
            out.append({**entry, "fieldsV1": to_v1(kept)})
    if mine:
        out.append(_entry(manager, UPDATE, after.get("apiVersion", ""), mine, now))
    return out


def apply(live: Obj | None, config: Obj, manager: str, *, force: bool, now: str) -> Obj:
    """The object after ``manager`` applies ``config`` to ``live`` (None: it does not exist yet)."""
    applied = fields(config)
    entries = _entries(live)
    previous = next((_owned(e) for e in entries if _is(e, manager, APPLY)), frozenset())
    others = [(e, _owned(e)) for e in entries if not _is(e, manager, APPLY)]
    conflicts = {(e["manager"], p) for e, owned in others for p in owned & applied
                 if p[-1] != ITEM and value_at(live or {}, p) != value_at(config, p)}
    if conflicts and not force:
        raise Conflict(conflicts)
    taken = {p for _, p in conflicts}
    others = [(e, owned - taken) for e, owned in others]
    kept_by_others = frozenset().union(*(owned for _, owned in others))
    body = copy.deepcopy(live or {})
    for path in sorted(previous - applied, key=len, reverse=True):
        inside = path[:-1] if path[-1] == ITEM else path
        if not any(p[:len(inside)] == inside for p in kept_by_others | applied):
            _remove(body, path)
    body = _merged(body, {k: v for k, v in config.items() if k != "status"})
    body.setdefault("metadata", {})["managedFields"] = [
        *({**e, "fieldsV1": to_v1(owned)} for e, owned in others if owned),
        _entry(manager, APPLY, config.get("apiVersion", ""), applied, now),
    ]
    return body
