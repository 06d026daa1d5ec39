"""Static checks of the Kubernetes manifests under deploy/k8s (no cluster needed).

    .venv/bin/python deploy/k8s/check.py [deploy/k8s/overlays/gpu ...]   # exit 1 on any error

1. **Build** each kustomization with a small strategic merge written here (no kustomize
   binary needed): ``resources`` (files and directories, recursively), ``images``
   (newName/newTag by image name) and ``patches`` (strategic-merge patch files whose kind and
   name select the target). Merge rule, as Kubernetes' strategic merge for the fields used
   here: maps merge key by key (a ``null`` deletes), lists of maps that all carry ``name``
   (containers, env, ports, volumes, volumeMounts) merge by ``name``, any other list is
   replaced (e.g. the HPA's ``metrics``, tolerations). Configuration generators, name
   prefixes, namespaces and labels transformers are not supported and rejected: the
   manifests do not use them. tests/test_k8s.py checks this build equals ``kubectl
   kustomize`` where kubectl is installed.
2. **Schemas**: every object against the Kubernetes OpenAPI schemas (PyPI
   ``kubernetes-validate``, strict: unknown fields are errors).
3. **Policy** (what the schemas cannot know): probes on a declared container port, the port
   the service listens on (ATTNSCOPE_PORT); startup and readiness on /readyz, liveness on
   /healthz; cpu and memory requests and limits on every container, OMP_NUM_THREADS equal to
   the CPU limit; ``nvidia.com/gpu`` limit 1 when a GPU is asked for; grace period longer
   than preStop + uvicorn's 30 s drain; API keys from a Secret; the Service, PDB and HPA
   pointing at the Deployment's pods and port; scrape annotations on the metrics port.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
OVERLAYS = [HERE / "base", HERE / "overlays" / "gpu", HERE / "overlays" / "queue-autoscaling"]
K8S_VERSIONS = ["1.29.0", "1.37.0"]  # oldest and newest supported here
UVICORN_DRAIN_S = 30  # service/cli.py: timeout_graceful_shutdown
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}


def _load_docs(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def merge(base: Any, patch: Any) -> Any:
    """Strategic merge of ``patch`` into ``base`` (rules in the module docstring)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and base and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out)}
        for item in patch:
            if item["name"] in index:
                out[index[item["name"]]] = merge(out[index[item["name"]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _split_image(image: str) -> tuple[str, str | None]:
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon + 1:]
    return image, None


def _set_images(doc: dict, images: list[dict]) -> None:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        name, tag = _split_image(c["image"])
        for rule in images:
            if rule["name"] == name:
                name = rule.get("newName", name)
                tag = rule.get("newTag", tag)
        c["image"] = name + (f":{tag}" if tag else "")


def build(kdir: Path) -> list[dict]:
    """The objects ``kubectl kustomize kdir`` would print (for the features listed above)."""
    kdir = Path(kdir)
    k = _load_docs(kdir / "kustomization.yaml")[0]
    unknown = set(k) - SUPPORTED_KEYS
    if unknown:
        raise ValueError(f"{kdir}/kustomization.yaml: unsupported here: {sorted(unknown)}")
    docs: list[dict] = []
    for res in k.get("resources", []):
        p = (kdir / res).resolve()
        docs.extend(build(p) if p.is_dir() else _load_docs(p))
    for entry in k.get("patches", []):
        for patch in _load_docs(kdir / entry["path"]):
            hits = [i for i, d in enumerate(docs) if d["kind"] == patch["kind"]
                    and d["metadata"]["name"] == patch["metadata"]["name"]]
            if len(hits) != 1:
                raise ValueError(f"{kdir}/{entry['path']}: patch matches {len(hits)} objects")
            docs[hits[0]] = merge(docs[hits[0]], patch)
    for d in docs:
        _set_images(d, k.get("images", []))
    return docs


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
        elif got != listen:
            errs.append(f"{probe}: port {got} is not the service's port {listen}")
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
    docs = build(kdir)
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
