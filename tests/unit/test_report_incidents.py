"""The report tells each failure's story: a run recorded once from a real LocalCluster job
(tests/data/runs/warm-spare-shrink-grow: two nodes and a warm spare; a node killed, the
spare takes its rank; the other original node killed with no spare waiting, the job
shrinks to one rank; a spare started later, the job grows back to two) reads, in the
report's Incidents, as three recoveries with their path, time, steps redone and who was
lost and who replaced them; and the summary counts its generations, its world size range
and prices the checkpoint-interval advice with those warm recoveries."""

import re
from pathlib import Path

import pytest
from conftest import ROOT
from needs import module, tool
from report_page import row, section
from test_report import Log, two_attempts_with_a_hang

from llmtrain.events import read_events
from llmtrain.report.html import write_report

RECORDED = ROOT / "tests" / "data" / "runs" / "warm-spare-shrink-grow"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[str, dict[str, dict], Path]:
    """The recorded run's report page, its warm changes by kind, and the report dir."""
    out = tmp_path_factory.mktemp("report")
    events = read_events(str(RECORDED))
    changes = {e["kind"]: e for e in events if e["event"] in ("warm_recovery", "warm_grow")}
    index = write_report(str(RECORDED), str(out))
    return Path(index).read_text(encoding="utf-8"), changes, out


def test_each_warm_recovery_shrink_and_grow_is_an_incident_with_its_path_and_time(recorded):
    page, changes, _ = recorded
    incidents = section(page, "incidents")
    spare, shrink, grow = (row(incidents, name) for name in
                           ("warm recovery", "warm shrink", "warm grow"))
    # the spare: node2 (rank 0) killed, node3 took rank 0; state of step 20, 26 reached
    assert "<td>rank 0 on node2 → node3</td><td>warm spare</td>" in spare
    assert f"<td>{changes['spare']['total_s']:.2f} s</td><td>6 (steps 21-26)</td>" in spare
    assert "its collective failed (a peer was gone) at step 26" in spare
    assert "Connection reset by peer" in spare and "pair.cc" not in spare
    # the shrink: node1 (rank 1) killed with no spare waiting; rank 0 goes on alone
    assert "<td>rank 1 on node1 → none</td><td>warm shrink</td>" in shrink
    assert f"<td>{changes['shrink']['total_s']:.2f} s</td><td>0</td>" in shrink
    assert "went on as 1 rank(s) (from 2) from the state of step 50" in shrink
    # the grow: node4 joined as rank 1 at step 94
    assert "<td>+ 1 on node4</td><td>warm grow</td>" in grow
    assert f"<td>{changes['grow']['total_s']:.2f} s</td>" in grow
    assert "voted to grow at step 94" in grow and "went on as 2 ranks (from 1)" in grow
    # the survivors' own reports are the detection, not rows; the clock warnings one row
    assert "<td>failure</td>" not in incidents
    assert incidents.count("<td>health</td>") == 1
    assert "WARN clock on node1, node2, node3, node4:" in incidents
    assert incidents.index(spare) < incidents.index(shrink) < incidents.index(grow)


def test_the_summary_counts_generations_world_sizes_and_prices_warm_recoveries(recorded):
    page, changes, out = recorded
    # the count as the console's first line said it (459,392 parameters)
    assert "<th>Model</th><td>debug, 459.4K params, 1-2 ranks on cpu</td>" in page
    assert ("<th>Attempts</th><td>1 (0 cold restarts), 4 generations: 1 warm spare, "
            "1 warm shrink, 1 warm grow</td>") in page
    assert re.search(r"<th>World size</th><td>1-2 ranks: 2 → 1 \([\d.]+ s in\) → 2 ", page)
    assert (f"<th>Recoveries</th><td>3: warm spare {changes['spare']['total_s']:.2f} s, warm "
            f"shrink {changes['shrink']['total_s']:.2f} s, warm grow "
            f"{changes['grow']['total_s']:.2f} s") in page
    advice = re.search(r"<th>Checkpoint interval advice</th><td>([^<]*)</td>", page)[1]
    mean = (changes["spare"]["total_s"] + changes["shrink"]["total_s"]) / 2
    assert f", {mean:.1f} s per failure, the mean of 2 warm recoveries (" in advice, advice
    assert "cold" not in advice
    attempts = section(page, "attempts")
    assert "<td>0, gen 1</td>" in attempts and "<td>0, gen 3</td>" in attempts
    assert "<td>step 50 from memory (warm shrink)</td>" in attempts
    assert (out / "world_size.png").stat().st_size > 10_000
    assert 'alt="World size"' in page


def test_the_report_of_the_recorded_run_reads_in_a_browser(recorded):
    """Headless Chromium, as the docs' report test: no console error, and the Incidents
    table's text names each recovery's path and time."""
    chromium = tool("chromium", "apt-get install chromium")
    playwright = module("playwright.sync_api", "pip install playwright")
    _, changes, out = recorded
    problems = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: m.type == "error" and problems.append(m.text))
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto((out / "index.html").as_uri(), wait_until="load")
        rows = page.eval_on_selector_all(
            "#incidents + p + table tbody tr",
            "rows => rows.map(r => Array.from(r.cells, c => c.innerText))")
        width = page.eval_on_selector('img[alt="World size"]', "i => i.naturalWidth")
        browser.close()
    assert problems == []
    assert width > 100
    told = {r[2]: (r[4], r[5]) for r in rows}
    assert told["warm recovery"] == ("warm spare", f"{changes['spare']['total_s']:.2f} s")
    assert told["warm shrink"] == ("warm shrink", f"{changes['shrink']['total_s']:.2f} s")
    assert told["warm grow"] == ("warm grow", f"{changes['grow']['total_s']:.2f} s")


def test_a_cold_restart_is_told_with_its_detection_time_and_steps_redone(tmp_path):
    """The hang run of test_report, with the new attempt's ``recovery`` event as rank 0
    writes it after its first step: rank 2 died silently, the hang detected it."""
    log = two_attempts_with_a_hang()
    (hang,) = [e for e in log.records if e["event"] == "hang"]
    (second,) = [e for e in log.records if e["event"] == "attempt_start"][1:]
    log.emit("recovery", at=second["ts"] + 12.0, total_s=27.5, silent_ranks=[2],
             marks={"last_progress": hang["ts"] - 65, "failure_detected": hang["ts"],
                    "first_step": hang["ts"] + 27.5},
             parts_s={"failure_detected->process_start": 14.0})
    log.write(str(tmp_path / "run"))
    page = Path(write_report(str(tmp_path / "run"))).read_text(encoding="utf-8")
    cold = row(section(page, "incidents"), "cold restart")
    assert "<td>rank 2 → a new process</td><td>cold</td>" in cold
    assert "<td>27.50 s</td><td>20 (steps 21-40)</td>" in cold  # logged every 10 steps
    assert "rank 2 lost without a word (node-b excluded)" in cold
    assert "detected: the watchdog&#x27;s hang verdict after 60 s: rank 2 is stuck" in cold
    assert "(node-b excluded)" in cold and "resumed from the checkpoint of step 20" in cold
    advice = re.search(r"<th>Checkpoint interval advice</th><td>([^<]*)</td>", page)[1]
    assert "27.5 s per failure, the mean of 1 cold restart (27.5 s)" in advice, advice


def test_the_straggler_heatmap_shows_for_any_window_of_a_run_with_two_ranks(tmp_path):
    """A two-rank run whose only window compared one node's ranks (the other's arrivals
    missing, as just after a warm recovery) still gets its heatmap, a row per rank."""
    log = Log(world=2)
    log.attempt(0, "node-a")
    log.train(1, 10)
    log.records = [e for e in log.records if e["event"] != "straggler_scores"]
    log.emit("straggler_scores", step=10, ranks=1, collectives=40, top=[[0, 1.0]], p50=1.0,
             p90=1.0, p99=1.0)
    log.write(str(tmp_path / "run"))
    page = Path(write_report(str(tmp_path / "run"))).read_text(encoding="utf-8")
    assert 'alt="Stragglers"' in page and "No figure" not in page
    assert "<th>Stragglers</th><td>no straggler" in page


def test_every_kind_of_failure_has_its_row(tmp_path):
    """A failed GPU whose warm recovery fails, so the job restarts cold; then a store
    outage, a hang whose ranks are evicted, a rank stuck in a collective, a desync and a
    fatal error: each is a row of its own, the cold restart names the failed GPU as its
    detection, and the ranks' own reports of the failure are told by it, not listed."""
    log = Log()
    log.attempt(0, "node-a")
    log.train(1, 20)
    log.t += 1
    log.emit("health", rank=3, check="ecc_volatile", severity="fatal", gpu=3, host="node-b",
             message="uncorrectable ECC errors")
    log.emit("stop_vote", rank=3, step=20, at=log.t + 0.1)
    for rank in (0, 1, 2):
        log.emit("failure", rank=rank, step=20, path="warm", cause="peer", at=log.t + 0.5,
                 error="RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] "
                       "Read error: Connection reset by peer. This is typically caused by ...")
    log.emit("warm_recovery_failed", step=20, at=log.t + 1.0,
             reason="ColdPath: no spare waits and the survivors cannot hold rank 3's shards")
    log.t += 5
    log.attempt(1, "node-a", resume=20)
    log.train(21, 40)
    log.emit("recovery", total_s=12.0, silent_ranks=[], marks={}, parts_s={})
    log.emit("fence_unreachable", rank=1, what="save", mine="r1/g0", timeout_s=10.0,
             error="TimeoutError: timed out")
    log.emit("warm_path_off", rank=None, host="node-c", reason="no rendezvous store outside "
                                                               "the workers")
    log.t += 3
    log.emit("hang", id="hang-2", reason="rank 2 made no progress for 60 s", verdict="rank 2 "
             "is stuck in backward", culprits=[2], report="r.md", detected_after_s=60)
    log.emit("evicted", id="hang-2", ranks=[2], unreachable={})
    log.emit("collective_stuck", rank=3, host="node-b", waited_s=7.5,
             collective={"pg": "mesh_tp", "seq": 156, "op": "gloo:all_reduce"})
    log.emit("process_paused", rank=1, host="node-a", seconds=29.1, step=33)
    log.emit("collective_error", id="collective_error-3", reason="desync: ranks called "
             "different collectives", culprits=[1], detected_after_s=2)
    log.emit("checkpoint_failed", rank=1, step=40, error="RuntimeError: [/__w/pytorch/pytorch/"
             "third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[10.77.0.2]:720. This is typically caused by a remote worker crashing. GLHF!\n"
             "(at distributed/distributed_c10d.py:4287 in all_gather)")
    log.emit("fatal", host="node-a", step=40, error="TrainingDiverged: loss is NaN")
    log.write(str(tmp_path / "run"))
    page = Path(write_report(str(tmp_path / "run"))).read_text(encoding="utf-8")
    incidents = section(page, "incidents")
    assert "<td>failure</td>" not in incidents  # told by the cold restart
    assert "FATAL ecc_volatile on node-b GPU 3: uncorrectable ECC errors" in row(incidents,
                                                                                  "health")
    assert "voted to stop at step 20" in row(incidents, "stop vote")
    failed = row(incidents, "warm recovery failed")
    assert "<td>warm → cold</td>" in failed and "no spare waits" in failed
    cold = row(incidents, "cold restart")
    assert "<td>cold</td><td>12.00 s</td><td>0</td>" in cold
    assert "detected: a failed health check: FATAL ecc_volatile on node-b GPU 3" in cold
    assert "(and 4 more reports)" in cold  # the vote and the three survivors' failures
    assert "store fault: the rendezvous store did not answer (save)" in row(
        incidents, "fence unreachable")
    assert "warm recovery is off on node-c" in row(incidents, "warm path off")
    assert "evicted rank(s) 2 after hang-2" in row(incidents, "evicted")
    assert "<td>1</td>" in row(incidents, "collective error")
    assert ("rank 3 on node-b was stuck 7.5 s in gloo:all_reduce #156 on mesh_tp"
            in row(incidents, "collective stuck"))
    assert ("rank 1 on node-a did not run for 29.1 s at step 33" in row(incidents,
                                                                        "process paused"))
    assert "TrainingDiverged: loss is NaN" in row(incidents, "fatal")
    # a transport's error without its source location and boilerplate
    assert ("checkpoint of step 40 failed: RuntimeError: Connection closed by peer "
            "[10.77.0.2]:720</td>") in row(incidents, "checkpoint failed")
    assert "<td>fatal</td>" in section(page, "attempts")


def test_ranks_that_say_the_same_are_one_row(tmp_path):
    """Every rank saying the warm path is off, for the same reason on the same node, is
    one row naming them all; another node's word is a row of its own."""
    log = Log(world=2)
    log.attempt(0, "node-a")
    for rank in (0, 1):
        log.emit("warm_path_off", rank=rank, host="node-a", at=log.t + rank * 0.1,
                 reason="no rendezvous store outside the workers (run under llmtrain launch)")
    log.emit("warm_path_off", rank=None, host="node-b", reason="warm.enable is false")
    log.train(1, 10)
    log.write(str(tmp_path / "run"))
    page = Path(write_report(str(tmp_path / "run"))).read_text(encoding="utf-8")
    rows = re.findall(r"<tr class=\w+>.*?</tr>", section(page, "incidents"))
    off = [r for r in rows if "<td>warm path off</td>" in r]
    assert len(off) == 2, off
    (a,) = [r for r in off if "on node-a" in r]
    (b,) = [r for r in off if "on node-b" in r]
    assert "<td>0, 1</td>" in a and "(said 2 times, until" in a
    assert "said" not in b


def test_a_node_lost_as_the_next_round_formed_is_the_cold_restarts_detection(tmp_path):
    """A failed GPU's warm recovery fails; the cold round that follows loses a node before
    its process group forms (its ranks say ``round_node_lost`` and end), and the round
    after it trains: the restart names that loss, and the first attempt's row says what
    ended it and then its round."""
    log = Log()
    log.attempt(0, "node-a")
    log.train(1, 20)
    log.t += 1
    log.emit("warm_recovery_failed", step=20, reason="ColdPath: rank 1 was lost with its buddy")
    log.t += 2
    log.emit("round_node_lost", rank=0, host="node-a", nodes=["node-b"])
    log.t += 2
    log.attempt(1, "node-a", resume=20)
    log.train(21, 30)
    log.emit("recovery", total_s=6.0, silent_ranks=[], marks={}, parts_s={})
    log.write(str(tmp_path / "run"))
    page = Path(write_report(str(tmp_path / "run"))).read_text(encoding="utf-8")
    cold = row(section(page, "incidents"), "cold restart")
    assert "detected: rendezvous node(s) node-b died before the process group formed" in cold
    assert ("<td>warm recovery failed, then a node of the next round died before its group "
            "formed</td>") in section(page, "attempts")
