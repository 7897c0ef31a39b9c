"""traffic: the weights the operator sets on the user's HTTPRoute (pure; the controller applies them)."""
import logging
from typing import Any

import pytest

from specdecode.operator import kube, names
from specdecode.operator.controller import _route
from specdecode.operator.loop import Unwritten
from specdecode.operator.reconcile import APPLY_FAILED, ROUTE_REFUSED
from specdecode.operator.resolve import Resolved, resolve
from specdecode.operator.traffic import RouteError, backends, route_patch


def resolved(port: int = 8000) -> Resolved:
    body = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "demo", "namespace": "llm"},
            "spec": {"model": {"uri": "smollm2-135m"}, "image": "specdecode/runtime:test", "service": {"port": port},
                     "rollout": {"trafficRouting": {"httpRoute": "gateway"}}}}
    answer = resolve(body)
    assert answer.allowed, answer.message
    return answer.resolved


def route(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "gateway", "namespace": "llm", "resourceVersion": "41", "uid": "u"},
            "spec": {"parentRefs": [{"name": "public"}], "hostnames": ["llm.example.com"], "rules": list(rules)}}


def ref(name: str, **more: Any) -> dict[str, Any]:
    return {"name": name, "port": 8000, **more}


CHAT = {"matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}], "backendRefs": [ref("demo")]}
OTHER = {"matches": [{"path": {"type": "PathPrefix", "value": "/admin"}}], "backendRefs": [ref("admin-ui")]}


# Gateway API v1 refuses backendRefs beside a RequestRedirect filter (422): such a rule is never ours.
REDIRECT = {"matches": [{"path": {"type": "PathPrefix", "value": "/old"}}],
            "filters": [{"type": "RequestRedirect", "requestRedirect": {"path": {"type": "ReplaceFullPath",
                                                                               "replaceFullPath": "/v1"}}}]}


def test_rules_pointing_at_this_resource_get_the_weighted_services() -> None:
    patch = route_patch(route(CHAT, OTHER, REDIRECT, {"filters": []}), resolved(), 30)
    assert patch["metadata"] == {"name": "gateway", "namespace": "llm", "resourceVersion": "41"}
    assert set(patch) == {"apiVersion", "kind", "metadata", "spec"} and set(patch["spec"]) == {"rules"}
    chat, other, redirect, empty = patch["spec"]["rules"]
    weighted = [{"name": "demo-stable", "port": 8000, "weight": 70}, {"name": "demo-canary", "port": 8000, "weight": 30}]
    assert chat == {"matches": CHAT["matches"], "backendRefs": weighted}  # matches kept
    assert other == OTHER  # another application's rule is left alone
    assert (redirect, empty) == (REDIRECT, {"filters": []})  # rules without backends too


def test_nothing_to_do_when_the_weights_are_set_even_with_server_defaults() -> None:
    defaulted = [{"group": "", "kind": "Service", **b} for b in backends(resolved(), 50)]
    assert route_patch(route({"backendRefs": defaulted}, OTHER), resolved(), 50) is None
    assert route_patch(route({"backendRefs": defaulted}), resolved(), 60) is not None


def test_a_route_without_a_rule_of_ours_is_reported() -> None:
    foreign = [
        {"backendRefs": [ref("admin-ui")]},
        {"backendRefs": [ref("demo", namespace="elsewhere")]},
        {"backendRefs": [ref("demo", kind="ServiceImport", group="multicluster.x-k8s.io")]},
        {"backendRefs": [ref("demo"), ref("admin-ui")]},  # shared with something else: not ours to rewrite
        REDIRECT, {"matches": CHAT["matches"]},  # no backends: nothing says they are ours
    ]
    with pytest.raises(RouteError, match="HTTPRoute gateway has no rule whose backends are Service demo"):
        route_patch(route(*foreign), resolved(), 0)


def test_backends_use_the_service_port() -> None:
    assert [b["port"] for b in backends(resolved(port=80), 10)] == [80, 80]
    assert [b["weight"] for b in backends(resolved(), 0)] == [100, 0]


def test_a_route_the_api_server_refuses_is_a_status_condition_not_a_crash() -> None:
    """A policy engine or validation answering the route patch with a 4xx: the weights are not
    set, ``RouteRefused`` with the server's words, traffic follows the replica ratio; a 5xx is
    ``ApplyFailed`` and the weight is not in effect (the next pass sets it)."""
    message = ('HTTPRoute.gateway.networking.k8s.io "gateway" is invalid: spec.rules[0]: Invalid value: "object": '
               "RequestRedirect filter must not be used together with backendRefs")
    failure = {"status": 422}

    class Refusing:
        def serves(self, _: str) -> bool:
            return True

        def read(self, *_: Any) -> dict[str, Any]:
            return route(CHAT)

        def patch_unless_changed(self, _: dict[str, Any]) -> bool:
            raise kube.WriteFailed(failure["status"], message)

    warnings, in_effect, unwritten = _route(Refusing(), resolved(), 30, logging.getLogger("test"))
    assert in_effect and not warnings
    assert unwritten == Unwritten(ROUTE_REFUSED, f"HTTPRoute gateway refused the weights: {message}; traffic "
                                                 "follows the replica ratio")
    failure["status"] = 503
    _, in_effect, unwritten = _route(Refusing(), resolved(), 30, logging.getLogger("test"))
    assert not in_effect and unwritten == Unwritten(APPLY_FAILED, f"HTTPRoute gateway: {message}")
