"""The deployment files are valid: Prometheus config and rules (promtool), Kubernetes YAML
probing /health, and a Dockerfile that copies what exists."""

import os
import re
import shutil
import subprocess

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


def test_kubernetes_manifest_probes_health():
    with open(os.path.join(DEPLOY, "kubernetes", "loom.yaml")) as f:
        docs = list(yaml.safe_load_all(f))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    shutdown = float(container["args"][container["args"].index("--shutdown-timeout") + 1])
    assert grace > shutdown


def test_dockerfile_copies_existing_paths():
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        text = f.read()
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        assert os.path.exists(os.path.join(ROOT, src)), src
