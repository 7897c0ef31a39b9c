"""The CRD's own chart, charts/specdecode-crds: it lints clean and renders exactly the generated CRD,
kept on uninstall, as a template (so ``helm upgrade`` upgrades it); the operator chart no longer
carries it. The upgrade itself, on a real API server: test_operator_realk8s_crd_upgrade.py."""
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

from specdecode.operator import crd

REPO = Path(__file__).resolve().parents[1]
CRD_CHART = REPO / "charts" / "specdecode-crds"


def rendered_crd_chart() -> list[dict]:
    chart = helm.Chart.load(CRD_CHART)
    manifests = chart.render({}, name="specdecode-crds", namespace="default", is_install=True)
    assert not chart.crds  # a crds/ folder is installed once and never upgraded: everything is a template
    return [obj for text in manifests.values() for obj in yaml.safe_load_all(text) if obj]


def test_the_crd_chart_lints_and_renders_the_generated_crd_kept_on_uninstall():
    report = helm.lint(CRD_CHART, None, strict=True, kube_version="v1.30.0")
    assert report["total_charts_linted"] == 1 and not report["errors"], report
    (rendered,) = rendered_crd_chart()
    assert rendered == crd.build_crd()
    assert rendered["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    kubernetes_validate.validate(rendered, "1.30", strict=True)


def test_the_operator_chart_carries_no_specdecode_crd():
    chart = helm.Chart.load(REPO / "charts" / "specdecode")
    assert crd.CRD_FILE not in {Path(c["filename"]).name for c in chart.crds}
