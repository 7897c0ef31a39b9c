"""The webhook's certificates as the chart renders them for cert-manager (issue 36): a self-signed
root signs a CA, a CA Issuer signs the serving (leaf) certificate, and the caBundle is the CA's,
so it stays the same when the leaf is re-issued.

The references are followed in the rendered objects; then cert-manager is emulated with openssl on
exactly those objects. An Issuer with ``selfSigned`` signs a Certificate with the Certificate's
own key, one with ``ca`` with the key in the Secret it names; every Secret's ``ca.crt`` is the
signer's certificate (the certificate itself when self-signed); a renewal issues into the same
Secret, keeping the key only with ``privateKey.rotationPolicy: Never`` (cert-manager's default is
``Always`` since 1.18); the cainjector copies the ``ca.crt`` of the Certificate that
``cert-manager.io/inject-ca-from`` names into the caBundle. A leaf is trusted when ``openssl
verify`` accepts it against that caBundle for the Service's DNS name, as the API server must.
"""
import base64
import copy
import math
import re
import subprocess
from pathlib import Path

import helm_python as helm
import pytest
from test_chart import CERT_MANAGER_VALUES, NAMESPACE, Obj, chart, kinds, only, openssl, render  # noqa: F401 (fixture)

INJECT_CA_FROM = "cert-manager.io/inject-ca-from"
DEFAULT_DURATION = "2160h"  # cert-manager's when a Certificate names none (90 days)
GO_DURATION = re.compile(r"([0-9]+)(ms|s|m|h)")
SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


@pytest.fixture(scope="module")
def objs(chart) -> list[Obj]:
    return render(chart, CERT_MANAGER_VALUES)


def named(objs: list[Obj], kind: str, name: str) -> Obj:
    (obj,) = [o for o in objs if (o["kind"], o["metadata"]["name"]) == (kind, name)]
    return obj


def injected_from(objs: list[Obj]) -> Obj:
    """The Certificate whose Secret's ca.crt becomes the webhook's caBundle."""
    namespace, name = only(objs, "ValidatingWebhookConfiguration")["metadata"]["annotations"][INJECT_CA_FROM].split("/")
    assert namespace == NAMESPACE
    return named(objs, "Certificate", name)


def issuer_of(objs: list[Obj], certificate: Obj) -> Obj:
    ref = certificate["spec"]["issuerRef"]
    assert ref["kind"] == "Issuer"  # the chart's own issuers are namespaced
    return named(objs, "Issuer", ref["name"])


def serving_certificate(objs: list[Obj]) -> Obj:
    """The Certificate whose Secret the operator pods mount."""
    volumes = only(objs, "StatefulSet")["spec"]["template"]["spec"]["volumes"]
    mounted = {v["secret"]["secretName"] for v in volumes if "secret" in v}
    (leaf,) = [o for o in objs if o["kind"] == "Certificate" and o["spec"]["secretName"] in mounted]
    return leaf


def service_host(objs: list[Obj]) -> str:
    """The DNS name the API server calls: the rendered Service the webhook names."""
    (webhook,) = only(objs, "ValidatingWebhookConfiguration")["webhooks"]
    service = named(objs, "Service", webhook["clientConfig"]["service"]["name"])["metadata"]
    return f"{service['name']}.{service['namespace']}.svc"


def days(duration: str) -> int:
    """A Go duration (cert-manager's spelling, e.g. 87600h) in whole days, for openssl."""
    assert GO_DURATION.sub("", duration) == "", duration
    return math.ceil(sum(int(n) * SECONDS[unit] for n, unit in GO_DURATION.findall(duration)) / 86400)


# -- the references ------------------------------------------------------------------------------


def test_webhook_trusts_a_long_lived_ca_the_self_signed_issuer_signs(objs):
    (webhook,) = only(objs, "ValidatingWebhookConfiguration")["webhooks"]
    assert "caBundle" not in webhook["clientConfig"]  # the cainjector's to fill
    ca = injected_from(objs)["spec"]
    assert ca["isCA"] is True and ca["commonName"]
    assert issuer_of(objs, injected_from(objs))["spec"] == {"selfSigned": {}}
    assert ca["secretName"] != serving_certificate(objs)["spec"]["secretName"]
    assert days(ca["duration"]) == 3650 > days(DEFAULT_DURATION)
    assert ca["privateKey"]["rotationPolicy"] == "Never"  # why: test_ca_renewal_keeps_earlier_leaves_trusted


def test_leaf_comes_from_the_ca_issuer_for_the_webhook_service(objs):
    leaf, ca = serving_certificate(objs), injected_from(objs)
    assert leaf is not ca and not leaf["spec"].get("isCA")
    assert issuer_of(objs, leaf)["spec"] == {"ca": {"secretName": ca["spec"]["secretName"]}}
    assert leaf["spec"]["dnsNames"] == [service_host(objs)]


def test_with_the_users_issuer_the_serving_certificates_ca_is_injected(chart):
    """No chain of the chart's own: the caBundle is whatever CA the user's issuer puts in ca.crt
    (the README says which issuers keep it stable)."""
    issuer = {"name": "corporate-ca", "kind": "ClusterIssuer"}
    objs = render(chart, {"webhook": {"certManager": {"enabled": True, "issuerRef": issuer}}})
    assert "Issuer" not in kinds(objs)
    assert injected_from(objs) == serving_certificate(objs) and serving_certificate(objs)["spec"]["issuerRef"] == issuer


@pytest.mark.parametrize("duration", ["10y", "87600", 87600])
def test_ca_duration_must_be_a_go_duration(chart, duration):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"webhook": {"certManager": {"caDuration": duration}}})


# -- cert-manager emulated -----------------------------------------------------------------------


class CertManager:
    """Issues the rendered Certificates into Secrets (folders holding tls.crt, tls.key, ca.crt)."""

    def __init__(self, objs: list[Obj], root: Path):
        self.objs, self.root = objs, root

    def secret(self, name: str) -> Path:
        return self.root / name

    def issue(self, certificate: Obj) -> None:
        """Issues or renews ``certificate`` as its issuer would; its signer's Secret must exist."""
        spec, issuer = certificate["spec"], issuer_of(self.objs, certificate)["spec"]
        secret = self.secret(spec["secretName"])
        secret.mkdir(exist_ok=True)
        key = private_key(spec.get("privateKey", {}), secret / "tls.key")
        signer = self.secret(issuer["ca"]["secretName"]) if "ca" in issuer else None
        config = self.root / f"{certificate['metadata']['name']}.cnf"
        config.write_text(openssl_config(spec), encoding="utf-8")
        subject = f"/CN={spec['commonName']}" if "commonName" in spec else "/"
        by_ca = ["-CA", str(signer / "tls.crt"), "-CAkey", str(signer / "tls.key")] if signer else []
        openssl("req", "-x509", "-new", "-config", str(config), "-key", str(key), "-subj", subject,
                "-days", str(days(spec.get("duration", DEFAULT_DURATION))), *by_ca, "-out", str(secret / "tls.crt"))
        (secret / "ca.crt").write_bytes(((signer or secret) / "tls.crt").read_bytes())

    def issue_all(self) -> None:
        """Every Certificate in the rendered order (the CA's comes before the leaf it signs)."""
        for certificate in [o for o in self.objs if o["kind"] == "Certificate"]:
            self.issue(certificate)

    def ca_bundle(self) -> bytes:
        """What the cainjector puts in the ValidatingWebhookConfiguration."""
        return (self.secret(injected_from(self.objs)["spec"]["secretName"]) / "ca.crt").read_bytes()

    def serving(self) -> bytes:
        """The leaf the operator pods serve (their mounted tls.crt)."""
        return (self.secret(serving_certificate(self.objs)["spec"]["secretName"]) / "tls.crt").read_bytes()


def private_key(spec: Obj, path: Path) -> Path:
    """The Secret's key, kept on renewal only with rotationPolicy Never; else a new one."""
    if path.exists() and spec.get("rotationPolicy") == "Never":
        return path
    if spec.get("algorithm", "RSA") == "ECDSA":
        options = ["-algorithm", "EC", "-pkeyopt", f"ec_paramgen_curve:P-{spec.get('size', 256)}"]
    else:
        options = ["-algorithm", "RSA", "-pkeyopt", f"rsa_keygen_bits:{spec.get('size', 2048)}"]
    openssl("genpkey", *options, "-out", str(path))
    return path


def openssl_config(spec: Obj) -> str:
    """The extensions cert-manager gives a Certificate with this spec (default usages: digital
    signature, key encipherment; a CA also signs certificates)."""
    usages = "digitalSignature, keyEncipherment" + (", keyCertSign" if spec.get("isCA") else "")
    lines = ["[req]", "distinguished_name = subject", "x509_extensions = extensions", "[subject]", "[extensions]",
             f"basicConstraints = critical, CA:{'TRUE' if spec.get('isCA') else 'FALSE'}",
             f"keyUsage = critical, {usages}", "subjectKeyIdentifier = hash", "authorityKeyIdentifier = keyid:always"]
    if spec.get("dnsNames"):
        lines.append("subjectAltName = " + ", ".join(f"DNS:{name}" for name in spec["dnsNames"]))
    return "\n".join(lines) + "\n"


def trusts(ca_bundle: bytes, leaf: bytes, host: str, tmp: Path) -> bool:
    """Whether a client holding ``ca_bundle`` accepts ``leaf`` as the server ``host``."""
    (tmp / "bundle.pem").write_bytes(ca_bundle)
    (tmp / "leaf.pem").write_bytes(leaf)
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(tmp / "bundle.pem"), "-purpose", "sslserver",
                             "-verify_hostname", host, str(tmp / "leaf.pem")], capture_output=True, timeout=30)
    return verify.returncode == 0


def old_chain(objs: list[Obj]) -> list[Obj]:
    """The rendered objects as the chart made them before this chain: the leaf signed by the
    self-signed Issuer directly and injected itself as the caBundle."""
    old = copy.deepcopy(objs)
    leaf, root = serving_certificate(old), issuer_of(old, injected_from(old))
    leaf["spec"]["issuerRef"]["name"] = root["metadata"]["name"]
    configuration = only(old, "ValidatingWebhookConfiguration")
    configuration["metadata"]["annotations"][INJECT_CA_FROM] = f"{NAMESPACE}/{leaf['metadata']['name']}"
    return old


def test_ca_bundle_stays_and_trusts_the_leaf_across_two_renewals(objs, tmp_path):
    manager, host = CertManager(objs, tmp_path), service_host(objs)
    manager.issue_all()
    ca_bundle, leaves = manager.ca_bundle(), [manager.serving()]
    for _ in range(2):
        manager.issue(serving_certificate(objs))
        leaves.append(manager.serving())
        assert manager.ca_bundle() == ca_bundle
    assert len(set(leaves)) == 3  # really re-issued, each time with a new key
    assert all(trusts(ca_bundle, leaf, host, tmp_path) for leaf in leaves)
    assert not trusts(ca_bundle, leaves[-1], "elsewhere.example.com", tmp_path)


def test_old_chain_renewed_leaf_fails_the_previous_ca_bundle(objs, tmp_path):
    """The negative control: what the chain fixes, seen with the same emulation."""
    old = old_chain(objs)
    manager, host = CertManager(old, tmp_path), service_host(old)
    manager.issue_all()
    ca_bundle = manager.ca_bundle()
    assert ca_bundle == manager.serving()  # the leaf is its own caBundle
    manager.issue(serving_certificate(old))
    assert manager.ca_bundle() != ca_bundle
    assert not trusts(ca_bundle, manager.serving(), host, tmp_path)  # refused until the cainjector catches up
    assert trusts(manager.ca_bundle(), manager.serving(), host, tmp_path)


def renew_the_ca(objs: list[Obj], tmp_path: Path) -> tuple[bytes, bytes, bytes, CertManager]:
    """Issues the chain, then renews the CA: the caBundle before and after, the leaf issued before,
    and the emulator."""
    manager = CertManager(objs, tmp_path)
    manager.issue_all()
    ca_bundle, leaf = manager.ca_bundle(), manager.serving()
    manager.issue(injected_from(objs))
    return ca_bundle, manager.ca_bundle(), leaf, manager


def test_ca_renewal_keeps_earlier_leaves_trusted(objs, tmp_path):
    """Every ~6.7 years (two thirds of caDuration) the CA itself renews: same key, so the leaf
    signed before verifies against the new caBundle and the next leaf against the old one."""
    before, after, leaf, manager = renew_the_ca(objs, tmp_path)
    host = service_host(objs)
    assert after != before and trusts(after, leaf, host, tmp_path)
    manager.issue(serving_certificate(objs))
    assert trusts(before, manager.serving(), host, tmp_path)


def test_a_ca_renewed_with_a_new_key_would_fail_earlier_leaves(objs, tmp_path):
    """The control for rotationPolicy Never: with cert-manager's default (Always) the leaf signed
    before the CA renewed is refused until it is re-issued."""
    rotating = copy.deepcopy(objs)
    injected_from(rotating)["spec"]["privateKey"]["rotationPolicy"] = "Always"
    before, after, leaf, _ = renew_the_ca(rotating, tmp_path)
    assert trusts(before, leaf, service_host(objs), tmp_path) and not trusts(after, leaf, service_host(objs), tmp_path)


# -- without cert-manager ------------------------------------------------------------------------


def test_helm_generated_ca_bundle_is_the_ca_not_the_serving_certificate(chart, tmp_path):
    """Helm's genCA/genSignedCert path: the caBundle is the CA that signed tls.crt (reused through
    ``lookup`` on upgrade, which offline rendering cannot show)."""
    objs = render(chart, {})
    secret = only(objs, "Secret")["data"]
    (webhook,) = only(objs, "ValidatingWebhookConfiguration")["webhooks"]
    assert webhook["clientConfig"]["caBundle"] == secret["ca.crt"] != secret["tls.crt"]
    assert INJECT_CA_FROM not in only(objs, "ValidatingWebhookConfiguration")["metadata"].get("annotations", {})
    ca = tmp_path / "ca.pem"
    ca.write_bytes(base64.b64decode(secret["ca.crt"]))
    assert "CA:TRUE" in openssl("x509", "-in", str(ca), "-noout", "-ext", "basicConstraints")
    assert trusts(ca.read_bytes(), base64.b64decode(secret["tls.crt"]), service_host(objs), tmp_path)
