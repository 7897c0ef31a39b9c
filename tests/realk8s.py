"""A real Kubernetes control plane on loopback: etcd, kube-apiserver and kube-controller-manager,
started by the test session (the real-control-plane tier, tests/README.md).

Binaries, in envtest's convention (``etcd``, ``kube-apiserver``, ``kubectl`` in a folder):
``$KUBEBUILDER_ASSETS`` if set, else what scripts/build_kube.sh built into its cache
(``~/.cache/specdecode/kube-<hash of the script>/``, built offline on the first run, ~8 minutes).
envtest ships no ``kube-controller-manager``: without one in ``$KUBEBUILDER_ASSETS`` the built one
runs beside the given API server. With ``CI=true`` a missing binary fails the run; elsewhere the
tier is skipped, saying why.

``control_plane`` (session) starts etcd (``--unsafe-no-fsync``), then kube-apiserver (a CA and
serving certificate made with openssl for 127.0.0.1/localhost; a static token file; service
account issuer and keys; RBAC; ``OwnerReferencesPermissionEnforcement``, on in OpenShift and other
hardened clusters; an audit log at Metadata level, read by ``ControlPlane.audit``), installs the
CRDs it is given, and only then kube-controller-manager (the garbage collector's resource list is
read at start), with per-controller service account credentials. Every wait has a deadline and
fails with the end of the process' log.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
import pytest
import yaml
from local_process import free_port
from operator_harness import crd_of

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "scripts" / "build_kube.sh"
BUILD_TIMEOUT_SECONDS = 40 * 60
START_TIMEOUT_SECONDS = 90.0  # each process, on a busy 2-core machine (apiserver /readyz: ~6 s idle)
STOP_TIMEOUT_SECONDS = 15.0
ADMIN = "realk8s-admin"  # in system:masters
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"  # bound by the bootstrap RBAC policy
TEST_USER_AGENT = "specdecode-realk8s-tests"  # the tests' own requests, told apart in the audit log
# Without the node, cloud, service, route and workload controllers: no kubelet runs here.
CONTROLLERS = "garbagecollector,namespace,serviceaccount,serviceaccount-token"
ADMISSION_PLUGINS = "OwnerReferencesPermissionEnforcement"
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata"}]}
T = TypeVar("T")
Obj = dict[str, Any]


def other_project_crd(group: str, version: str, kind: str, plural: str) -> Obj:
    """Another project's API with an open schema (``crd_of``); a ``*.k8s.io`` group's CRD must say
    whether its API was approved (the real Gateway API's links its review)."""
    crd = crd_of(group, version, kind, plural)
    if group.endswith(".k8s.io"):
        crd["metadata"]["annotations"] = {"api-approved.kubernetes.io": "unapproved, a test's open-schema stand-in"}
    return crd


# Other projects' APIs the operator uses, served as a cluster with them installed serves them.
# LeaderWorkerSet is left out: a cluster gains it mid-life (issue 19 item 2).
OTHER_CRDS = (other_project_crd("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes"),
              other_project_crd("monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors"))


# -- binaries -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    apiserver: Path
    controller_manager: Path

    @staticmethod
    def minor(binary: Path) -> int:
        """The minor version a Kubernetes binary reports (``Kubernetes v1.20.2`` → 20)."""
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=True)
        return int(out.stdout.split()[-1].lstrip("v").split(".")[1])


def build(log: Path) -> Path:
    """scripts/build_kube.sh's folder: its cache, built first if the cache is empty."""
    with log.open("w") as err:
        done = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=err, text=True,
                              timeout=BUILD_TIMEOUT_SECONDS, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} exited {done.returncode}:\n{tail(log)}")
    return Path(done.stdout.strip().splitlines()[-1])


def find_binaries(env: dict[str, str], log: Path) -> Binaries:
    assets = Path(env["KUBEBUILDER_ASSETS"]) if env.get("KUBEBUILDER_ASSETS") else None
    built: Path | None = None
    if assets is None or not (assets / "kube-controller-manager").is_file():
        built = build(log)
    folder = assets or built
    assert folder is not None
    binaries = Binaries(folder / "etcd", folder / "kube-apiserver",
                        (built or folder) / "kube-controller-manager")
    missing = [str(p) for p in (binaries.etcd, binaries.apiserver, binaries.controller_manager) if not p.is_file()]
    if missing:
        raise RuntimeError(f"missing control-plane binaries: {', '.join(missing)}")
    return binaries


def binaries_or_skip(log: Path, announce: Callable[[str], None]) -> Binaries:
    """The binaries; if they cannot be had, a failure under ``CI=true``, else a skip saying why."""
    if not os.environ.get("KUBEBUILDER_ASSETS"):
        announce(f"real control plane: {BUILD_SCRIPT.name} (a cold build takes ~8 minutes; log {log})")
    try:
        return find_binaries(dict(os.environ), log)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"real control plane unavailable: {exc}", pytrace=False)
        pytest.skip(f"real control plane unavailable (CI=true makes this a failure): {exc}")


# -- processes ------------------------------------------------------------------------------------


def tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


@dataclass
class Process:
    """A server process in its own process group, its output in ``log``."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    cwd: Path | None = None
    popen: subprocess.Popen = field(init=False)

    @classmethod
    def start(cls, name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Process:
        process = cls(name, [str(a) for a in argv], log, env, cwd)
        process._spawn("wb")
        return process

    def start_again(self) -> None:
        """Once stopped: the same command and environment again, its output appended to ``log``
        (one growing text, so that offsets into it stay valid)."""
        if self.popen.poll() is None:
            raise AssertionError(f"{self.name} is still running")
        self._spawn("ab")

    def _spawn(self, mode: str) -> None:
        with self.log.open(mode) as out:
            self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                          cwd=self.cwd, start_new_session=True)

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.popen.returncode}:\n{tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM to the group; SIGKILL past the deadline."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(timeout=STOP_TIMEOUT_SECONDS)
                break
            except subprocess.TimeoutExpired:
                continue

    def kill(self) -> None:
        """SIGKILL to the group: no clean exit, as when a node is lost."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=STOP_TIMEOUT_SECONDS)


def wait_until(check: Callable[[], T], what: str, processes: Sequence[Process] = (),
               timeout: float = START_TIMEOUT_SECONDS, every: float = 0.2) -> T:
    """``check()``'s first truthy value; fails naming ``what`` past ``timeout``, or at once with
    its log if one of ``processes`` exits."""
    deadline, value = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        for process in processes:
            process.check_alive()
        value = check()
        if value:
            return value
        time.sleep(every)
    logs = "\n".join(f"--- {p.name}:\n{tail(p.log, 3000)}" for p in processes)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {value!r}\n{logs}")


# -- certificates and credentials -----------------------------------------------------------------


def openssl(*args: str | Path) -> None:
    subprocess.run([shutil.which("openssl") or "openssl", *map(str, args)], check=True, capture_output=True,
                   timeout=60)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "ca.crt", directory / "ca.key"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
            "-keyout", key, "-out", cert)
    return cert, key


def make_serving_cert(directory: Path, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    """tls.crt/tls.key for 127.0.0.1 and localhost, signed by ``ca``."""
    cert, key, csr, ext = (directory / n for n in ("tls.crt", "tls.key", "tls.csr", "tls.ext"))
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                   "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", csr)
    openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-set_serial",
            str(int.from_bytes(os.urandom(8), "big")), "-days", "2", "-extfile", ext, "-out", cert)
    return cert, key


def write_kubeconfig(path: Path, server: str, ca: Path, user: str, token: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": user,
        "clusters": [{"name": "realk8s", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "realk8s", "user": user}}],
    }))
    path.chmod(0o600)
    return path


def new_token() -> str:
    return os.urandom(24).hex()


# -- the control plane ----------------------------------------------------------------------------


@dataclass
class ControlPlane:
    """A running control plane: its URL, CA, the admin's kubeconfig and the audit log."""

    url: str
    ca: Path
    kubeconfig: Path  # the admin's (system:masters)
    audit_log: Path
    processes: list[Process]
    minor: int  # the API server's Kubernetes minor version

    def client(self) -> kubernetes.client.ApiClient:
        """An admin client whose requests the audit log shows with ``TEST_USER_AGENT``."""
        client = kubernetes.config.new_client_from_config(str(self.kubeconfig))
        client.user_agent = TEST_USER_AGENT
        return client

    def served(self) -> set[str]:
        """Every group/version the API server serves (``v1`` for the core group)."""
        with self.client() as client:
            groups = kubernetes.client.ApisApi(client).get_api_versions().groups
        return {"v1"} | {v.group_version for g in groups for v in g.versions}

    def audit(self) -> list[Obj]:
        """Every audit event so far (a last line still being written is left for the next read)."""
        lines = self.audit_log.read_text().split("\n")[:-1] if self.audit_log.exists() else []
        return [json.loads(line) for line in lines if line]

    def check_alive(self) -> None:
        for process in self.processes:
            process.check_alive()

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


def start_etcd(binaries: Binaries, root: Path) -> tuple[Process, str]:
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    etcd = Process.start("etcd", [
        binaries.etcd, "--name=realk8s", f"--data-dir={root / 'etcd'}", f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}", f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}", f"--initial-cluster=realk8s={peer_url}",
        "--unsafe-no-fsync", "--log-level=warn", "--logger=zap"], root / "etcd.log")
    wait_until(lambda: _get(f"{url}/health") == 200, "etcd /health", [etcd])
    return etcd, url


def start_apiserver(binaries: Binaries, root: Path, etcd: str, admin_token: str,
                    controller_manager_token: str) -> tuple[Process, str, Path, Path]:
    """(process, URL, CA certificate, CA key) once ``/readyz`` answers."""
    pki = root / "pki"
    ca = make_ca(pki, "realk8s-ca")
    serving = make_serving_cert(pki, ca)
    sa_key, sa_pub = pki / "sa.key", pki / "sa.pub"
    openssl("genrsa", "-out", sa_key, "2048")
    openssl("rsa", "-in", sa_key, "-pubout", "-out", sa_pub)
    tokens = pki / "tokens.csv"
    tokens.write_text(f'{admin_token},{ADMIN},{ADMIN},"system:masters"\n'
                      f"{controller_manager_token},{CONTROLLER_MANAGER_USER},{CONTROLLER_MANAGER_USER}\n")
    policy = root / "audit-policy.yaml"
    policy.write_text(yaml.safe_dump(AUDIT_POLICY))
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    removed_in_1_24 = ["--insecure-port=0"] if binaries.minor(binaries.apiserver) < 24 else []
    apiserver = Process.start("kube-apiserver", [
        binaries.apiserver, "--bind-address=127.0.0.1", f"--secure-port={port}", *removed_in_1_24,
        f"--etcd-servers={etcd}", f"--cert-dir={pki}", f"--tls-cert-file={serving[0]}",
        f"--tls-private-key-file={serving[1]}", f"--client-ca-file={ca[0]}", f"--token-auth-file={tokens}",
        "--authorization-mode=RBAC", f"--enable-admission-plugins={ADMISSION_PLUGINS}",
        f"--service-account-issuer={url}", f"--service-account-key-file={sa_pub}",
        f"--service-account-signing-key-file={sa_key}", f"--api-audiences={url}",
        "--service-cluster-ip-range=10.0.0.0/24", "--endpoint-reconciler-type=none",
        f"--audit-policy-file={policy}", f"--audit-log-path={root / 'audit.log'}", "--audit-log-format=json",
        "--audit-log-mode=blocking", "--profiling=false"], root / "kube-apiserver.log")
    context = ssl.create_default_context(cafile=str(ca[0]))
    wait_until(lambda: _get(f"{url}/readyz", admin_token, context) == 200, "kube-apiserver /readyz", [apiserver])
    return apiserver, url, ca[0], sa_key


def start_controller_manager(binaries: Binaries, root: Path, url: str, ca: Path, sa_key: Path,
                             token: str) -> Process:
    kubeconfig = write_kubeconfig(root / "kube-controller-manager.kubeconfig", url, ca, CONTROLLER_MANAGER_USER,
                                  token)
    removed_in_1_24 = ["--port=0"] if binaries.minor(binaries.controller_manager) < 24 else []
    return Process.start("kube-controller-manager", [
        binaries.controller_manager, f"--kubeconfig={kubeconfig}", "--leader-elect=false", *removed_in_1_24,
        "--secure-port=0", f"--controllers={CONTROLLERS}", "--use-service-account-credentials=true",
        f"--root-ca-file={ca}", f"--service-account-private-key-file={sa_key}"],
        root / "kube-controller-manager.log")


def install_crds(client: kubernetes.client.ApiClient, crds: Sequence[Obj], processes: Sequence[Process]) -> None:
    """Create each CRD and wait until it is established."""
    api = kubernetes.client.ApiextensionsV1Api(client)
    for crd in crds:
        api.create_custom_resource_definition(crd)
    for crd in crds:
        name = crd["metadata"]["name"]

        def established(name: str = name) -> bool:
            conditions = api.read_custom_resource_definition(name).status.conditions or []
            return any(c.type == "Established" and c.status == "True" for c in conditions)

        wait_until(established, f"CRD {name} established", processes)


def wait_for_garbage_collector(client: kubernetes.client.ApiClient, processes: Sequence[Process]) -> None:
    """The collector runs once it has synced: an orphaned ConfigMap disappears."""
    core = kubernetes.client.CoreV1Api(client)
    owner = core.create_namespaced_config_map("default", {"metadata": {"name": "realk8s-gc-probe-owner"}})
    core.create_namespaced_config_map("default", {"metadata": {"name": "realk8s-gc-probe", "ownerReferences": [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": owner.metadata.name, "uid": owner.metadata.uid}]}})
    core.delete_namespaced_config_map(owner.metadata.name, "default")
    names = lambda: {c.metadata.name for c in core.list_namespaced_config_map("default").items}  # noqa: E731
    wait_until(lambda: "realk8s-gc-probe" not in names(), "the garbage collector to collect a probe", processes)


def start_control_plane(binaries: Binaries, root: Path, crds: Sequence[Obj]) -> ControlPlane:
    """etcd, kube-apiserver, the ``crds``, then kube-controller-manager; stopped again if any fails."""
    processes: list[Process] = []
    try:
        etcd, etcd_url = start_etcd(binaries, root)
        processes.append(etcd)
        admin_token, cm_token = new_token(), new_token()
        apiserver, url, ca, sa_key = start_apiserver(binaries, root, etcd_url, admin_token, cm_token)
        processes.append(apiserver)
        plane = ControlPlane(url, ca, write_kubeconfig(root / "admin.kubeconfig", url, ca, ADMIN, admin_token),
                             root / "audit.log", processes, binaries.minor(binaries.apiserver))
        with plane.client() as client:
            install_crds(client, crds, processes)
            processes.append(start_controller_manager(binaries, root, url, ca, sa_key, cm_token))
            wait_for_garbage_collector(client, processes)
        return plane
    except BaseException:
        for process in reversed(processes):
            process.stop()
        raise


def _get(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> int | None:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


# -- the fixture ----------------------------------------------------------------------------------


def chart_crds() -> list[Obj]:
    """The CRDs the charts install: the CRD chart's templates (installed before the operator chart)
    and whatever the operator chart's crds/ folder holds (which Helm installs before its templates)."""
    folders = [REPO / "charts" / "specdecode-crds" / "templates", REPO / "charts" / "specdecode" / "crds"]
    return [obj for folder in folders for path in sorted(folder.glob("*.yaml"))
            for obj in yaml.safe_load_all(path.read_text()) if obj]


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[ControlPlane]:
    """The session's control plane, the chart's CRDs and ``OTHER_CRDS`` installed."""
    root = tmp_path_factory.mktemp("realk8s")
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    announce = (lambda line: reporter.write_line(line)) if reporter else print
    binaries = binaries_or_skip(root / "build.log", announce)
    plane = start_control_plane(binaries, root, [*chart_crds(), *OTHER_CRDS])
    try:
        yield plane
    finally:
        plane.stop()
