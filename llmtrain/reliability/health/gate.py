"""The preflight gate: a node with a fatal finding, or one excluded earlier in the run,
never joins the job. ``llmtrain launch`` runs it before torchrun; ``llmtrain health --gate``
runs it alone."""

from __future__ import annotations

import logging
from dataclasses import asdict

from llmtrain.config import JobConfig
from llmtrain.events import EventLog
from llmtrain.exit_codes import ExitCode
from llmtrain.reliability.health.checks import (Backend, Finding, HealthChecker, open_backend,
                                                table, to_json)
from llmtrain.reliability.health.exclusion import exclude_host, excluded_hosts

log = logging.getLogger(__name__)


def check_node(cfg: JobConfig, host: str) -> tuple[list[Finding], dict[int, dict], Backend | None]:
    """Every check of this node: its GPUs, and the run's and checkpoints' storage."""
    storage = {"run_storage": cfg.training.run_dir}
    if cfg.checkpoint.enable:
        storage["checkpoint_storage"] = cfg.checkpoint_url
    checker = HealthChecker(cfg.health, open_backend(cfg.health), host=host, storage=storage)
    findings, values = checker.run()
    return findings, values, checker.backend


def run_gate(cfg: JobConfig, host: str, as_json: bool = False) -> ExitCode:
    """A fatal finding (or an earlier exclusion) keeps the node out of the job; it is
    recorded in the run's excluded_hosts.json. Warnings let it join."""
    run_dir = cfg.training.run_dir
    if host in (excluded := excluded_hosts(run_dir)):
        log.error("llmtrain health: %s was excluded from this run earlier: %s; remove it "
                  "from %s/excluded_hosts.json once it is repaired", host,
                  excluded[host]["reason"], run_dir)
        return ExitCode.EXCLUDE_NODE
    findings, values, backend = check_node(cfg, host)
    print(to_json(findings, values, backend) if as_json else table(findings))
    fatal = [f for f in findings if f.severity == "fatal"]
    if not fatal:
        return ExitCode.CLEAN
    reason = "; ".join(f.sentence() for f in fatal)
    exclude_host(run_dir, host, reason, findings=[asdict(f) for f in fatal])
    events = EventLog(run_dir, rank=None)
    events.emit("node_excluded", host=host, reason=reason, source="gate")
    events.close()
    log.error("llmtrain health: %s excluded from the run: %s", host, reason)
    return ExitCode.EXCLUDE_NODE
