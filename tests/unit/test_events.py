"""The event log's readers: what a crash or concurrent appenders leave is skipped, never
fatal, so the launcher, goodput, the exporter and the report all read on."""

import json

from llmtrain.events import EventLog, EventTail, read_events


def test_torn_last_line_and_garbled_middle_line_are_skipped(tmp_path):
    log = EventLog(str(tmp_path), rank=0)
    log.emit("step", step=1)
    log.close()
    with open(tmp_path / "events.jsonl", "ab") as f:
        f.write(b'{"ts": 1, "eve\x00\xff garbled by two appenders\n')   # a bad middle line
        f.write(b'[1, 2]\n' + json.dumps({"ts": 2, "event": "step", "step": 2}).encode() + b"\n")
        f.write(b'{"ts": 3, "event": "st')                                  # torn: no newline
    tail = EventTail(str(tmp_path))
    assert [e["step"] for e in read_events(str(tmp_path), "step")] == [1, 2]
    assert [e["step"] for e in tail.read()] == [1, 2]
    with open(tmp_path / "events.jsonl", "ab") as f:  # the torn line's writer finishes it
        f.write(b'ep", "step": 3}\n')
    assert [e["step"] for e in tail.read()] == [3]
    assert [e["step"] for e in read_events(str(tmp_path), "step")] == [1, 2, 3]
