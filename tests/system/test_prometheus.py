"""A real Prometheus server scrapes a running 2-rank job through the project's own scrape
config and alert rules; killing a rank fires the alert that names it."""

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import needs
import pytest
import yaml
from conftest import ROOT, llmtrain_start

from llmtrain.distributed.process_group import free_port


@pytest.fixture
def prometheus(tmp_path):
    """Prometheus on loopback with monitoring/prometheus.yml and monitoring/alerts.yml,
    made fast for a test: 1 s scrapes and evaluations, alerts without their `for:` wait."""
    exe = needs.tool("prometheus", "Debian/Ubuntu: apt-get install prometheus")
    d = tmp_path / "prom"
    (d / "targets").mkdir(parents=True)
    config = yaml.safe_load((ROOT / "monitoring/prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "llmtrain"]
    job["file_sd_configs"] = [{"files": [str(d / "targets/*.json")], "refresh_interval": "1s"}]
    rules = yaml.safe_load((ROOT / "monitoring/alerts.yml").read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            rule.pop("for", None)
    (d / "alerts.yml").write_text(yaml.safe_dump(rules))
    config["rule_files"] = [str(d / "alerts.yml")]
    (d / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [exe, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(d / "prometheus.log", "w"))
    api = Api(f"http://127.0.0.1:{port}/api/v1", d)
    try:
        api.until(lambda: api.get("status/runtimeinfo"), "Prometheus to start", 30)
        yield api
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class Api:
    def __init__(self, base: str, root: Path):
        self.base, self.root, self.targets = base, root, root / "targets"

    def get(self, path: str, **params):
        url = f"{self.base}/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.load(r)["data"]
        except OSError:
            return None

    def query(self, expr: str) -> list[dict]:
        return (self.get("query", query=expr) or {}).get("result", [])

    def until(self, probe, what: str, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = probe()
            if value:
                return value
            time.sleep(0.5)
        log = (self.root / "prometheus.log").read_text()[-3000:]
        raise AssertionError(f"timed out waiting for {what}\nprometheus log:\n{log}")


def value(series: dict) -> float:
    return float(series["value"][1])


def test_prometheus_scrapes_the_job_and_alerts_on_a_killed_rank(prometheus, tmp_path):
    run = tmp_path / "run"
    proc = llmtrain_start(run, "--training.steps", "2000", "--metrics.port", "0",
                          "--metrics.targets_dir", str(prometheus.targets),
                          "--metrics.run_name", "promtest", "--metrics.goodput_every_s", "1",
                          "--metrics.log_every", "5", "--checkpoint.interval_steps", "40",
                          nproc=2)
    try:
        steps = prometheus.until(lambda: [s for s in prometheus.query("llmtrain_step") if
                                          value(s) >= 60] if len(prometheus.query(
                                              "llmtrain_step")) == 2 else None,
                                 "both ranks' steps past 60", 180)
        assert {s["metric"]["rank"] for s in prometheus.query("llmtrain_step")} == {"0", "1"}
        labels = steps[0]["metric"]
        assert labels["run"] == "promtest" and labels["host"] == socket.gethostname()
        assert labels["job"] == "llmtrain" and "local_rank" in labels

        (loss,) = prometheus.query('llmtrain_loss{run="promtest"}')  # rank 0 reports it
        assert 0.5 < value(loss) < 6
        (tps,) = prometheus.query("llmtrain_tokens_per_second")
        assert value(tps) > 1000
        # a rate needs two scrapes of each rank's histogram: with two-block steps both
        # ranks can pass step 60 before the second one
        p50 = prometheus.until(lambda: r if len(r := prometheus.query(
            "histogram_quantile(0.5, rate(llmtrain_step_seconds_bucket[30s]))")) == 2 else None,
            "both ranks' step-time p50", 60)
        assert len(p50) == 2 and all(0.01 < value(s) < 5 for s in p50)
        ages = prometheus.query("time() - llmtrain_heartbeat_timestamp_seconds")
        assert len(ages) == 2 and all(value(a) < 10 for a in ages)
        assert [value(s) for s in prometheus.query("llmtrain_world_size")] == [2, 2]
        (committed,) = prometheus.until(lambda: prometheus.query(
            "llmtrain_checkpoint_last_committed_step > 0"), "a committed checkpoint", 60)
        assert value(committed) % 40 == 0
        (ettr,) = prometheus.query("llmtrain_goodput_ratio")
        assert 0 < value(ettr) <= 1
        badput = prometheus.query("llmtrain_badput_seconds")
        assert {s["metric"]["category"] for s in badput} >= {"startup", "checkpoint_stall"}
        # nothing is wrong yet, except that this VM's clock is not NTP-synchronized
        firing = [a["metric"] for a in prometheus.query('ALERTS{alertstate="firing"}')]
        assert all(a.get("check") == "clock" for a in firing), firing

        # Kill rank 1 outright: its exporter stops answering while its target stays listed.
        subprocess.run(["kill", "-9", str(_rank_pid(prometheus.targets, "1"))], check=True)
        # (torchrun then stops rank 0 too; whether its exporter outlives it varies)
        alerts = prometheus.until(lambda: [a for a in prometheus.get("alerts")["alerts"]
                                           if a["labels"]["alertname"] == "LLMTrainTargetDown"
                                           and a["state"] == "firing"
                                           and a["labels"].get("rank") == "1"],
                                  "LLMTrainTargetDown to fire for rank 1", 60)
        assert alerts[0]["labels"]["host"] == socket.gethostname()
        assert "rank 1" in alerts[0]["annotations"]["summary"], alerts
    finally:
        proc.kill()
        proc.wait()


def _rank_pid(targets: Path, rank: str) -> int:
    """The pid listening on rank ``rank``'s exporter port, from its file_sd entry."""
    for f in targets.glob("*.json"):
        (entry,) = json.loads(f.read_text())
        if entry["labels"]["rank"] == rank:
            port = int(entry["targets"][0].rsplit(":", 1)[1])
            out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True,
                                 text=True, check=True).stdout
            return int(out.split("pid=")[1].split(",")[0])
    raise AssertionError(f"no target file for rank {rank} in {targets}")
