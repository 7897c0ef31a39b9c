"""Least privilege on the real control plane, proven from the API server's audit log of
everything the operator did in the tier: never denied, and every verb the chart grants used.
These tests run after every other test of the tier (the ``after_realk8s_tier`` marker, conftest).
"""
from __future__ import annotations

from typing import Any

import pytest
from realk8s_cluster import Denied, RealCluster
from realk8s_operator import Operator, Release, denied, describe, granted, permissions, unprovable

pytestmark = [pytest.mark.realk8s, pytest.mark.after_realk8s_tier, pytest.mark.timeout(180, func_only=True)]

Obj = dict[str, Any]


class Unused(AssertionError):
    """The chart grants a verb the operator never used."""


@pytest.fixture(scope="module")
def operator_requests(cluster: RealCluster, operator: Operator) -> list[Obj]:
    """Every request of the operator in the tier, once it stopped (the API server logs a watch
    only when it ends)."""
    operator.stop()
    return cluster.operator_requests()


def test_the_operator_was_never_denied(operator_requests: list[Obj]) -> None:
    assert operator_requests
    denials = [describe(e) for e in operator_requests if denied(e)]
    if denials:
        raise Denied("\n".join(denials))


def test_every_verb_the_chart_grants_was_used(cluster: RealCluster, operator_requests: list[Obj],
                                              release: Release) -> None:
    used = set().union(*map(permissions, operator_requests))
    grants = granted(release.only("ClusterRole"))
    unused = grants - used - unprovable(grants, cluster.plane.served())
    if unused:
        raise Unused("granted, never used: " + ", ".join("/".join(p) for p in sorted(unused)))
