"""The deployment files are valid and locked down: Prometheus config and rules (promtool); a
Kubernetes Deployment probing /health and /live, running unprivileged on a read-only root, with
a required API key; replicas behind the SGLang router (found by their label, read-only RBAC,
flags the router parses) scaled on their queue; a two-stage Dockerfile whose final image has
prebuilt kernels and no compiler, on a base image pinned by digest."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT

DEPLOY = os.path.join(ROOT, "deploy")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_prometheus_files_pass_promtool():
    for kind, name in (("config", "prometheus.yml"), ("rules", "recording_rules.yml")):
        result = subprocess.run(["promtool", "check", kind, os.path.join(DEPLOY, "prometheus", name)],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


MANIFEST = os.path.join(DEPLOY, "kubernetes", "loom.yaml")
MANIFESTS = sorted(glob.glob(os.path.join(DEPLOY, "kubernetes", "*.yaml")))


def resources(name: str) -> dict[tuple[str, str], dict]:
    """A manifest's resources by (kind, name)."""
    with open(os.path.join(DEPLOY, "kubernetes", name)) as f:
        return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(f) if d}


def deployment_pod():
    with open(MANIFEST) as f:
        docs = list(yaml.safe_load_all(f))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def dockerfile_stages():
    """The Dockerfile's stages, each the text from its FROM line to the next."""
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        text = f.read()
    return re.split(r"^(?=FROM )", text, flags=re.M)[1:]


def test_kubernetes_manifest_probes_health():
    pod, container = deployment_pod()
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    grace = pod["terminationGracePeriodSeconds"]
    shutdown = float(container["args"][container["args"].index("--shutdown-timeout") + 1])
    assert grace > shutdown


def test_kubernetes_liveness_probe_asks_the_event_loop():
    """Liveness over HTTP on /live (200 while loading or draining), not a TCP connect that
    the kernel answers even when the event loop is stuck; a short timeout; both probe paths
    reachable without the API key."""
    from api_server.middleware import PUBLIC_PATHS

    _, container = deployment_pod()
    live = container["livenessProbe"]
    assert "tcpSocket" not in live and live["httpGet"]["path"] == "/live"
    assert live["httpGet"]["port"] == "http" and live["timeoutSeconds"] <= 2
    assert {"/live", container["readinessProbe"]["httpGet"]["path"]} <= PUBLIC_PATHS


def test_kubernetes_metrics_are_scraped_without_the_key():
    """/metrics needs the key unless --metrics-public, and the annotations' scrape job sends
    none: the autoscaler reads the queue through it."""
    from api_server.cli import build_parser

    with open(MANIFEST) as f:
        deployment = next(d for d in yaml.safe_load_all(f) if d["kind"] == "Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"
    _, container = deployment_pod()
    assert build_parser().parse_args(["serve", *container["args"]]).metrics_public


def test_kubernetes_pod_is_locked_down():
    pod, container = deployment_pod()
    for context in (pod["securityContext"], container["securityContext"]):
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    ctx = container["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add")
    # With a read-only root, /tmp (the IPC sockets, a privately rebuilt kernel) is an emptyDir.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]


def test_kubernetes_api_key_secret_is_required():
    """The image listens on 0.0.0.0, where loom refuses to start without a key: a missing
    secret must stop the pod from being created, not start it open (or crash-looping)."""
    _, container = deployment_pod()
    env = {e["name"]: e for e in container["env"]}
    ref = env["LOOM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"] and ref.get("optional", False) is False
    assert "--allow-unauthenticated" not in container.get("args", [])


@pytest.mark.parametrize("manifest", MANIFESTS, ids=os.path.basename)
def test_kubernetes_manifest_validates_against_the_api_schema(manifest):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    del kubernetes_validate
    result = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", manifest],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def router_container():
    router = resources("router.yaml")[("Deployment", "loom-router")]
    pod = router["spec"]["template"]
    return pod, pod["spec"]["containers"][0]


def router_args() -> list[str]:
    """The router's arguments as the kubelet passes them (its $(VAR)s expanded)."""
    _, container = router_container()
    values = {"POD_NAMESPACE": "inference", "LOOM_API_KEY": "key"}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in container["args"]]


def test_router_discovers_the_loom_pods():
    launch_router = pytest.importorskip("sglang_router.launch_router")
    args = launch_router.parse_router_args(router_args())
    args._validate_router_args()
    _, loom = deployment_pod()
    loom_deployment = resources("loom.yaml")[("Deployment", "loom")]
    loom_labels = loom_deployment["spec"]["template"]["metadata"]["labels"]
    router_pod, container = router_container()
    assert args.service_discovery and args.policy == "cache_aware"
    assert args.selector.items() <= loom_labels.items()  # finds the replicas...
    assert not args.selector.items() <= router_pod["metadata"]["labels"].items()  # ...not itself
    assert args.service_discovery_port == loom["ports"][0]["containerPort"]
    # Its own namespace (a Role is enough), from the downward API; the API key from loom's secret.
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert args.service_discovery_namespace == "inference"
    assert env["POD_NAMESPACE"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["LOOM_API_KEY"]["secretKeyRef"]["name"] == "loom" and args.api_key == "key"
    assert args.health_check_endpoint == loom["readinessProbe"]["httpGet"]["path"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    # Loopback-only defaults would make it unreachable in a pod; its ports are the ones named.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.host, args.port) == ("0.0.0.0", ports["http"])
    assert args.prometheus_port == ports["metrics"]
    headless = resources("router.yaml")[("Service", "loom-replicas")]["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"].items() <= loom_labels.items()


def test_router_may_only_read_pods():
    res = resources("router.yaml")
    pod, container = router_container()
    account = pod["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in res
    (rule,) = res[("Role", account)]["rules"]
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    binding = res[("RoleBinding", account)]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": account}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    ctx = container["securityContext"]
    assert ctx["runAsNonRoot"] and ctx["readOnlyRootFilesystem"]
    assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]


def test_autoscaler_reads_loom_queue_through_the_adapter():
    from api_server.metrics import Metrics

    res = resources("autoscaling.yaml")
    hpa = res[("HorizontalPodAutoscaler", "loom")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": "loom"}
    assert ("Deployment", "loom") in resources("loom.yaml")
    # The HPA owns the count: the Deployment must not reset it at every apply.
    assert "replicas" not in resources("loom.yaml")[("Deployment", "loom")]["spec"]
    assert 2 <= hpa["minReplicas"] < hpa["maxReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    adapter = res[("ConfigMap", "prometheus-adapter-loom")]["data"]["config.yaml"]
    (rule,) = yaml.safe_load(adapter)["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    series = re.match(r"^([\w:]+)\{", rule["seriesQuery"]).group(1)
    assert re.fullmatch(rule["name"]["matches"], series)
    names = {m.name for m in Metrics("m").registry.collect()}
    assert series == "loom:num_requests_waiting" and series in names
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


def test_dockerfile_copies_existing_paths():
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        text = f.read()
    for src in re.findall(r"^COPY (?!--from)(?:--\S+ )*(\S+)", text, re.M):
        assert os.path.exists(os.path.join(ROOT, src)), src


def test_dockerfile_copies_every_package_the_wheel_ships():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        copied = set(re.findall(r"^COPY (?!--from)(?:--\S+ )*(\S+)", f.read(), re.M))
    assert {p.rstrip("*") for p in include} <= copied


def test_dockerfile_ships_prebuilt_kernels_without_a_compiler():
    stages = dockerfile_stages()
    assert len(stages) >= 2
    builder, final = stages[0], stages[-1]
    assert re.search(r"\bgcc\b", builder) and "python -m worker.kernels" in builder
    # No compiler (nor anything that pulls one in) in the image that runs.
    for tool in ("gcc", "g++", "clang", "build-essential", "libc6-dev", " cc "):
        assert tool not in final, tool
    assert re.search(r"^COPY --from=builder /opt/loom/cache /opt/loom/cache$", final, re.M)
    # The kernels are keyed by their target: the final stage must name the one they were
    # built for, or it would look for native ones it cannot build.
    for stage in (builder, final):
        assert "LOOM_KERNEL_MARCH=${KERNEL_MARCH}" in stage and "ARG KERNEL_MARCH" in stage
    assert re.search(r"^ARG KERNEL_MARCH=x86-64-v\d$", _preamble(), re.M)  # a stated baseline
    assert re.search(r"^USER 10001(:10001)?$", final, re.M)  # the manifest's runAsUser


def test_dockerfile_pins_base_image_and_dependencies():
    preamble = _preamble()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", preamble, re.M).group(1)
    assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", base), base
    assert all(stage.startswith("FROM ${PYTHON_IMAGE}") for stage in dockerfile_stages())
    builder = dockerfile_stages()[0]
    installs = re.findall(r"pip install [^&]*", builder)
    assert installs and all("-c requirements/cpu-constraints.txt" in cmd or "--no-deps" in cmd
                            for cmd in installs), installs


def _preamble():
    """The Dockerfile's lines before the first FROM (the global build arguments)."""
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        return f.read().split("\nFROM ", 1)[0]
