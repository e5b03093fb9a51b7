"""monitoring/: the Prometheus config, the alert rules and their promtool unit tests, and the
Grafana dashboard, checked against what the exporter actually exports."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

import needs
from conftest import ROOT

MONITORING = ROOT / "monitoring"
DASHBOARD = MONITORING / "grafana" / "llmtrain.json"
ALERTS = MONITORING / "alerts.yml"
ALERT_TESTS = MONITORING / "alerts_test.yml"

STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
METRIC_IN_TEXT = re.compile(r"\bllmtrain_[a-z0-9_]+")


def promtool(*args: str, cwd: Path = ROOT) -> str:
    """Runs promtool; fails the test with its output unless it exits 0."""
    exe = needs.tool("promtool", "Debian/Ubuntu: apt-get install prometheus")
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"promtool {' '.join(args)} exited {proc.returncode}:\n{out}"
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: llmtrain_* and up (string literals such
    as label values are not names)."""
    return {t for t in IDENT.findall(STRING.sub("", expr)) if t.startswith("llmtrain_") or t == "up"}


def exported_series(metrics: dict[str, str]) -> dict[str, str]:
    """Series name -> the metric it belongs to, as prometheus-client exposes them."""
    out = {}
    for name, kind in metrics.items():
        assert kind in ("gauge", "counter", "histogram"), f"{name}: unknown type {kind!r}"
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        out.update({name + s: name for s in suffixes})
    return out


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]
            if "alert" in r]


def dashboard_exprs(dashboard: dict) -> dict[str, str]:
    """'panel title / refId' -> expr for every query in the dashboard."""
    return {f"{p['title']} / {t['refId']}": t["expr"]
            for p in all_panels(dashboard) for t in p.get("targets", [])}


# --- Prometheus config and alert rules -------------------------------------------------

def test_prometheus_config_is_valid():
    out = promtool("check", "config", "monitoring/prometheus.yml")
    assert "SUCCESS" in out and "alerts.yml" in out  # the rule file is found and checked too
    cfg = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    job, = [j for j in cfg["scrape_configs"] if j["job_name"] == "llmtrain"]
    assert job["honor_labels"] is True  # the exporter's run/rank/host labels are kept as is
    assert job["file_sd_configs"][0]["files"] == ["targets/*.json"]


def test_prometheus_config_reads_file_sd_written_by_ranks(tmp_path):
    """With a target file like the one each rank writes, the glob matches and promtool
    validates the file as well (the repository's targets/ is empty, so only a warning)."""
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(MONITORING / name, tmp_path / name)
    (tmp_path / "targets").mkdir()
    for rank in range(2):
        (tmp_path / "targets" / f"llama8b-rank{rank}.json").write_text(json.dumps([{
            "targets": [f"node-a:{9400 + rank}"],
            "labels": {"run": "llama8b", "rank": str(rank), "local_rank": str(rank),
                       "host": "node-a"}}]))
    out = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert "WARNING" not in out and "SUCCESS" in out, out


def test_alert_rules_are_valid():
    assert "SUCCESS" in promtool("check", "rules", "monitoring/alerts.yml")


def test_alert_rule_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", "monitoring/alerts_test.yml")


def test_every_alert_is_tested_firing_and_not_firing():
    alerts = {r["alert"] for r in alert_rules()}
    firing, quiet = set(), set()
    for group in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert alerts <= firing, f"never tested firing: {sorted(alerts - firing)}"
    assert alerts <= quiet, f"never tested not firing: {sorted(alerts - quiet)}"
    assert (firing | quiet) <= alerts, f"tests of unknown alerts: {sorted((firing | quiet) - alerts)}"


def test_alerts_say_how_bad_and_what_broke():
    """Each alert has a severity, and its text names every label it fires with (the run, and
    the rank, host, GPU or check where it keeps them), as the unit tests see it fire."""
    rules = {r["alert"]: r for r in alert_rules()}
    assert len(rules) == len(alert_rules()), "duplicate alert names"
    for name, r in rules.items():
        assert name.startswith("LLMTrain"), name
        assert r["labels"]["severity"] in ("critical", "warning"), name
        assert r["annotations"]["summary"].strip() and r["annotations"]["description"].strip()
    for group in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for case in group.get("alert_rule_test", []):
            r = rules[case["alertname"]]
            text = r["annotations"]["summary"] + r["annotations"]["description"]
            for alert in case.get("exp_alerts") or []:
                assert alert["exp_labels"]["severity"] == r["labels"]["severity"]
                for label in set(alert["exp_labels"]) - {"severity", "job", "local_rank"}:
                    assert f"$labels.{label}" in text, f"{case['alertname']}: {label} unnamed"


# --- Grafana dashboard ------------------------------------------------------------------

def test_dashboard_is_structurally_sound():
    d = load_dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert {"datasource", "run", "host", "rank"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("run", "host", "rank"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"]["uid"] == "${datasource}"
        assert variables[name]["definition"].startswith("label_values(")

    panels = all_panels(d)
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), "panel ids"
    cells = {}
    for p in panels:
        title = p.get("title")
        assert title, f"panel {p.get('id')} has no title"
        pos = p.get("gridPos")
        assert pos and all(isinstance(pos.get(k), int) for k in "hwxy"), f"{title}: gridPos"
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= 24, f"{title}: gridPos"
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{title} overlaps {cells[(x, y)]}"
                cells[(x, y)] = title
        if p["type"] == "row":
            continue
        assert p.get("datasource", {}).get("uid") == "${datasource}", f"{title}: datasource"
        targets = p.get("targets") or []
        assert targets, f"{title}: no query"
        refs = [t.get("refId") for t in targets]
        assert all(refs) and len(refs) == len(set(refs)), f"{title}: refIds {refs}"
        for t in targets:
            assert t.get("expr", "").strip(), f"{title} / {t.get('refId')}: empty expr"
            assert t.get("datasource", p["datasource"]) == p["datasource"], title
    titles = [p["title"] for p in panels if p["type"] == "row"]
    assert titles == ["Training", "Checkpoints", "Watchdog", "Health", "Elastic", "Goodput"]


def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses every panel's query, Grafana's variables filled in, as a recording rule."""
    fill = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h",
            "$run": ".*", "$host": ".*", "$rank": ".*"}
    rules = []
    for i, (where, expr) in enumerate(sorted(dashboard_exprs(load_dashboard()).items())):
        for var, value in fill.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{where}: unknown variable in {expr}"
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump({"groups": [
        {"name": "dashboard", "rules": rules}]}))
    assert "SUCCESS" in promtool("check", "rules", str(tmp_path / "dashboard.yml"))


# --- against the exporter's metrics -------------------------------------------------------

def exporter_metrics() -> dict[str, str]:
    from llmtrain.metrics.prometheus import METRICS
    return METRICS


def test_dashboard_and_alerts_query_only_exported_metrics():
    series = exported_series(exporter_metrics())
    d = load_dashboard()
    queries = dashboard_exprs(d)
    queries.update({f"variable {v['name']}": v["definition"]
                    for v in d["templating"]["list"] if v["type"] == "query"})
    queries.update({f"alert {r['alert']}": r["expr"] for r in alert_rules()})
    for r in alert_rules():  # the queries annotations run to name a host or a rank
        for key, text in r["annotations"].items():
            queries[f"alert {r['alert']} {key}"] = " ".join(METRIC_IN_TEXT.findall(text))
    unknown = {where: sorted(metric_names(q) - set(series) - {"up"})
               for where, q in queries.items()}
    unknown = {k: v for k, v in unknown.items() if v}
    assert not unknown, f"queries name series the exporter does not export: {unknown}"
    assert metric_names(queries["alert LLMTrainTargetDown"]) == {"up"}


def test_every_exported_metric_is_watched():
    series = exported_series(exporter_metrics())
    exprs = list(dashboard_exprs(load_dashboard()).values()) + [r["expr"] for r in alert_rules()]
    watched = {series[n] for e in exprs for n in metric_names(e) if n in series}
    unwatched = sorted(set(exporter_metrics()) - watched)
    assert not unwatched, f"exported but on no panel and in no alert: {unwatched}"
