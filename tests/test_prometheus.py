"""A real Prometheus server scrapes Loom on loopback; a TTFT quantile is read back through
Prometheus' own HTTP API. Skipped where the `prometheus` binary is absent (`make test`
installs Debian's package when it can). Loom is the session's shared tiny server
(conftest.tiny_server): its counters are read as what this test's requests added."""

import math
import shutil
import subprocess
import time

import httpx
import pytest

from tests.helpers import free_port
from tests.test_metrics import sample_or_zero

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus is not installed")


@pytest.fixture
def prometheus(tmp_path, tiny_server):
    loom = tiny_server
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 250ms\n  evaluation_interval: 250ms\n"
        "scrape_configs:\n  - job_name: loom\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{loom.port}']\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield loom, url
    finally:
        proc.terminate()
        proc.wait(10)


def query(url, expr):
    r = httpx.get(url + "/api/v1/query", params={"query": expr}).json()
    assert r["status"] == "success", r
    return r["data"]["result"]


def test_prometheus_reads_ttft_quantile(prometheus):
    loom, prom = prometheus
    # Let Prometheus take a first scrape before the traffic, so rate() sees the increase.
    deadline = time.monotonic() + 20
    while not query(prom, 'up{job="loom"} == 1') and time.monotonic() < deadline:
        time.sleep(0.25)
    before = sample_or_zero(httpx.get(loom.url + "/metrics").text, "loom:request_success_total",
                            finished_reason="length", model_name="tiny")
    for i in range(12):
        r = httpx.post(loom.url + "/v1/completions", json={
            "prompt": f"request {i}", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
    expr = ('histogram_quantile(0.5, sum by (le) '
            '(rate({__name__="loom:time_to_first_token_seconds_bucket",model_name="tiny"}[30s])))')
    value = float("nan")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = query(prom, expr)
        if result and not math.isnan(float(result[0]["value"][1])):
            value = float(result[0]["value"][1])
            break
        time.sleep(0.25)
    assert 0 < value < 5, value
    # The quantile can appear from a scrape taken mid-traffic; wait for a scrape after the last
    # request before reading the counter.
    expr = 'loom:request_success_total{finished_reason="length",model_name="tiny"}'
    finished = 0.0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        result = query(prom, expr)
        finished = float(result[0]["value"][1]) if result else 0.0
        if finished >= before + 12:
            break
        time.sleep(0.25)
    assert finished == before + 12
