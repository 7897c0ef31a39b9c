"""traffic: canary weights on the user's HTTPRoute (Gateway API), with ``rollout.trafficRouting``.

The operator does not create routes: a route belongs to whoever runs the Gateway (hostnames,
paths, filters, which Gateway). It rewrites the ``backendRefs`` of the rules that point at this
resource — at its Service, or at its stable and canary Services — to the stable and canary
Services weighted by ``status.rollout.canaryWeight``; other rules (a rule without backends, such as
a RequestRedirect, included: Gateway API v1 refuses backends beside a redirect) and every other
field stay as they are. The merge patch carries the route's ``resourceVersion``: an edit made in
between wins (409), and the next reconciliation sets the weights again.

Pure: the controller reads the route and applies the patch.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specdecode.operator import names
from specdecode.operator.reconcile import contains
from specdecode.operator.resolve import Resolved

Obj = dict[str, Any]


class RouteError(ValueError):
    """The route has no rule this resource may weigh; the message goes to status.warnings."""


def backends(r: Resolved, canary_weight: int) -> list[Obj]:
    """The weighted backendRefs of one rule (kind Service and core group are the API's defaults)."""
    port = r.spec.service.port
    return [{"name": names.stable_service_name(r.name), "port": port, "weight": 100 - canary_weight},
            {"name": names.canary_service_name(r.name), "port": port, "weight": canary_weight}]


def _ours(rule: Mapping[str, Any], r: Resolved) -> bool:
    """Whether ``rule`` has backends, each one of this resource's Services."""
    services = {names.service_name(r.name), names.stable_service_name(r.name), names.canary_service_name(r.name)}
    refs = rule.get("backendRefs") or []
    return bool(refs) and all(ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"
                              and ref.get("namespace", r.namespace) == r.namespace and ref.get("name") in services
                              for ref in refs)


def route_patch(route: Mapping[str, Any], r: Resolved, canary_weight: int) -> Obj | None:
    """The merge patch giving ``route``'s rules that are ours the weighted backends; None when
    they have them already. Raises ``RouteError`` when no rule is ours."""
    meta, rules = route["metadata"], list(route.get("spec", {}).get("rules") or [])
    ours = [i for i, rule in enumerate(rules) if _ours(rule, r)]
    if not ours:
        raise RouteError(f"HTTPRoute {meta['name']} has no rule whose backends are Service {names.service_name(r.name)} "
                         f"(or {names.stable_service_name(r.name)}/{names.canary_service_name(r.name)}): no traffic "
                         "weights set, traffic follows the replica ratio")
    wanted = backends(r, canary_weight)
    if all(contains(rules[i].get("backendRefs") or [], wanted) for i in ours):
        return None
    new_rules = [{**rule, "backendRefs": wanted} if i in ours else rule for i, rule in enumerate(rules)]
    return {"apiVersion": route["apiVersion"], "kind": route["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                         "resourceVersion": meta["resourceVersion"]},
            "spec": {"rules": new_rules}}
