"""Kubernetes and KServe manifests: schema-valid offline, and wired to each other and to the image."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the manifests (test extra)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is needed for the offline API schemas (test extra)")
import jsonschema  # noqa: E402  (kubernetes-validate depends on it)
from referencing import Registry, Resource  # noqa: E402

from dockerfile_model import parse_dockerfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "kubernetes"
KSERVE_DIR = ROOT / "deploy" / "kserve"
SCHEMAS = Path(__file__).parent / "schemas"
# Oldest Kubernetes we promise to run on, and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "servingruntime-serving-v1alpha1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice-serving-v1beta1.json",
}
NOT_API_OBJECTS = {("kustomize.config.k8s.io/v1beta1", "Kustomization")}


def _documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(list(K8S_DIR.glob("*.yaml")) + list(KSERVE_DIR.glob("*.yaml"))):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = _documents()


def _by_kind(kind: str) -> dict:
    found = [d for _, d in DOCS if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _k8s_definitions_registry() -> Registry:
    """The Kubernetes definitions, offline from kubernetes-validate, for the CRD schemas' $refs."""
    latest = kubernetes_validate.utils.latest_version()
    defs = kubernetes_validate.utils.schema_contents(
        f"kubernetes-json-schema/v{latest}-local-strict/_definitions.json", latest)
    return Resource.from_contents(defs) @ Registry()


def _validate_crd(doc: dict) -> None:
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])]).read_text())
    jsonschema.Draft202012Validator(schema, registry=_k8s_definitions_registry()).validate(doc)


def test_expected_objects_are_present():
    kinds = sorted(d["kind"] for _, d in DOCS)
    for kind in ("Deployment", "Service", "HorizontalPodAutoscaler", "PodMonitor", "PersistentVolumeClaim",
                 "ServingRuntime", "InferenceService"):
        assert kind in kinds, f"deploy/ has no {kind}"


@pytest.mark.parametrize("path,doc", DOCS, ids=[f"{p.parent.name}/{p.name}:{d['kind']}" for p, d in DOCS])
def test_manifest_matches_its_schema(path, doc):
    key = (doc["apiVersion"], doc["kind"])
    if key in NOT_API_OBJECTS:
        return
    if key in CRD_SCHEMAS:
        _validate_crd(doc)
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            pytest.fail(f"{path.name}: {doc['kind']} is invalid for Kubernetes {version} at {where}: {exc.message}")


def test_validators_reject_a_misspelled_field():
    """Guard against a validator that passes everything (wrong schema dir, lax mode)."""
    deployment = copy.deepcopy(_by_kind("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)
    monitor = copy.deepcopy(_by_kind("PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["paht"] = "/metrics"
    with pytest.raises(jsonschema.ValidationError):
        _validate_crd(monitor)
    runtime = copy.deepcopy(_by_kind("ServingRuntime"))
    runtime["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(jsonschema.ValidationError):
        _validate_crd(runtime)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def _container(pod_spec: dict) -> dict:
    (container,) = pod_spec["containers"]
    return container


def test_deployment_probes_gpu_shutdown_and_volume():
    dep = _by_kind("Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = _container(pod)
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert c["lifecycle"]["preStop"], "preStop lets the endpoint leave the Service before SIGTERM"
    assert pod["terminationGracePeriodSeconds"] >= 30
    claim = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/models")
    assert claim[mount["name"]]["persistentVolumeClaim"]["claimName"] == _by_kind("PersistentVolumeClaim")["metadata"]["name"]


def test_deployment_matches_the_image():
    final = parse_dockerfile(ROOT / "Dockerfile").final
    exposed = {int(p.split("/")[0]) for e in final.all("EXPOSE") for p in e.value.split()}
    pod = _by_kind("Deployment")["spec"]["template"]["spec"]
    c = _container(pod)
    assert {p["containerPort"] for p in c["ports"]} == exposed
    assert str(pod["securityContext"]["runAsUser"]) == final.last("USER").value.split(":")[0]
    assert "command" not in c, "keep the image's ENTRYPOINT (rnnserve); pass the subcommand in args"


@pytest.mark.parametrize("kind", ["Deployment", "ServingRuntime"])
def test_serve_arguments_are_accepted_by_rnnserve(kind):
    from service.settings import build_serve_parser

    obj = _by_kind(kind)
    spec = obj["spec"]["template"]["spec"] if kind == "Deployment" else obj["spec"]
    args = _container(spec)["args"]
    assert args[0] == "serve"
    parsed = build_serve_parser().parse_args(args[1:])
    ports = {p["name"]: p["containerPort"] for p in _container(spec)["ports"]}
    assert parsed.http_port == ports["http"] and parsed.grpc_port == ports["grpc"]


def _service_links(name: str, ports: list[dict]) -> dict[str, str]:
    """The variables Kubernetes gives every pod of the namespace for Service ``name`` (enableServiceLinks)."""
    n, ip = name.upper().replace("-", "_"), "10.96.0.10"
    env = {f"{n}_SERVICE_HOST": ip, f"{n}_SERVICE_PORT": str(ports[0]["port"]),
           f"{n}_PORT": f"tcp://{ip}:{ports[0]['port']}"}
    for p in ports:
        if "name" in p:
            env[f"{n}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
        base = f"{n}_PORT_{p['port']}_TCP"
        env.update({base: f"tcp://{ip}:{p['port']}", f"{base}_PROTO": "tcp", f"{base}_PORT": str(p["port"]),
                    f"{base}_ADDR": ip})
    return env


@pytest.mark.parametrize("kind", ["Deployment", "ServingRuntime"])
def test_the_server_starts_with_the_variables_kubernetes_adds(kind, monkeypatch):
    """Service links on (the default; KServe's pods have them): the Service rnnserve and KServe's predictor Service
    give variables named RNNSERVE_*, which the server's check for misspelt settings refused (a crash loop)."""
    from service.settings import ServeSettings

    isvc = _by_kind("InferenceService")["metadata"]["name"]
    links = {**_service_links(_by_kind("Service")["metadata"]["name"], _by_kind("Service")["spec"]["ports"]),
             **_service_links(f"{isvc}-predictor", [{"name": "http", "port": 80}])}
    assert any(k.startswith("RNNSERVE_") for k in links)
    obj = _by_kind(kind)
    spec = obj["spec"]["template"]["spec"] if kind == "Deployment" else obj["spec"]
    for var in [v for v in __import__("os").environ if v.startswith("RNNSERVE_")]:
        monkeypatch.delenv(var)
    for var, value in {**links, **{e["name"]: e["value"] for e in _container(spec).get("env", [])}}.items():
        monkeypatch.setenv(var, value)
    settings = ServeSettings.from_args(_container(spec)["args"][1:])
    assert str(settings.repository) in ("/models", "/mnt/models")  # KServe mounts its storage at /mnt/models


def test_service_routes_http_and_grpc_to_the_pods():
    svc = _by_kind("Service")
    pod_labels = _by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"] for p in _container(_by_kind("Deployment")["spec"]["template"]["spec"])["ports"]}
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["http"]["port"] == 8000 and ports["grpc"]["port"] == 8001
    assert {p["targetPort"] for p in ports.values()} <= port_names


def test_hpa_scales_the_deployment():
    hpa = _by_kind("HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", _by_kind("Deployment")["metadata"]["name"])
    assert hpa["spec"]["maxReplicas"] >= hpa["spec"].get("minReplicas", 1)


def test_podmonitor_scrapes_the_metrics_port():
    mon = _by_kind("PodMonitor")
    pod = _by_kind("Deployment")["spec"]["template"]
    assert mon["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (endpoint,) = mon["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in _container(pod["spec"])["ports"]}


def test_inferenceservice_uses_the_runtime():
    runtime = _by_kind("ServingRuntime")
    isvc = _by_kind("InferenceService")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["storageUri"]
    assert "v2" in runtime["spec"]["protocolVersions"]
    c = _container(runtime["spec"])
    # KServe's storage initializer puts storageUri's content at /mnt/models.
    assert c["args"][c["args"].index("--repository") + 1] == "/mnt/models"
    assert {p["containerPort"] for p in c["ports"]} == {8000, 8001}


def test_the_disruption_budget_lets_a_drain_evict_at_the_hpa_s_minimum():
    """minAvailable 1 with minReplicas 1 refused every eviction: `kubectl drain` hung until someone scaled up."""
    pdb = _by_kind("PodDisruptionBudget")["spec"]
    least = _by_kind("HorizontalPodAutoscaler")["spec"].get("minReplicas", 1)
    if "minAvailable" in pdb:
        assert int(pdb["minAvailable"]) < least
    else:
        assert int(pdb["maxUnavailable"]) >= 1
