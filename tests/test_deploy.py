"""The deployment files are valid and locked down: Prometheus config and rules (promtool); a
Kubernetes Deployment probing /health and /live, running unprivileged on a read-only root, with
a required API key; a two-stage Dockerfile whose final image has prebuilt kernels and no
compiler, on a base image pinned by digest."""

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


def test_kubernetes_manifest_validates_against_the_api_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    del kubernetes_validate
    result = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", MANIFEST],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_copies_existing_paths():
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        text = f.read()
    for src in re.findall(r"^COPY (?!--from)(?:--\S+ )*(\S+)", text, re.M):
        assert os.path.exists(os.path.join(ROOT, src)), src


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
