"""An attempt's event record: what it holds, and that writing it costs no copy of the manifest."""

from __future__ import annotations

import json
import threading

from lightning_shardckpt import read_events
from lightning_shardckpt.engine.metrics import CheckpointRecord, event_payload, write_event
from lightning_shardckpt.engine.storage import fsio


class _UncopyableManifest(dict):
    """A manifest that refuses to be deep-copied (as a lock does): any per-save copy of it fails loudly."""

    def __deepcopy__(self, memo):
        raise AssertionError("the manifest was deep-copied to write an event")


def test_an_event_holds_every_field_but_the_manifest_and_never_copies_it(tmp_path):
    manifest = _UncopyableManifest(tensors=[{"fqn": f"layer{i}.weight"} for i in range(1000)], lock=threading.Lock())
    ranks = [{"rank": 0, "bytes": 10, "write_s": 0.5, "write_gbps": 0.02}]
    record = CheckpointRecord(step=7, rank=0, outcome="committed", checkpoint_id="abc", ranks=ranks, manifest=manifest)

    payload = event_payload(record, {"committed": 1})
    assert "manifest" not in payload
    assert payload["step"] == 7 and payload["ranks"] == ranks and payload["counters"] == {"committed": 1}
    payload["ranks"][0]["bytes"] = 11  # the event's copy, not the record's
    assert record.ranks[0]["bytes"] == 10
    assert record.metrics()["checkpoint/write_s"] == 0.0

    root = fsio.resolve(str(tmp_path))
    write_event(root, record, {"committed": 1})
    [event] = read_events(root)
    assert event["checkpoint_id"] == "abc" and event["ranks"] == ranks and "manifest" not in event
    [name] = [p.name for p in (tmp_path / "events").iterdir()]
    assert json.loads((tmp_path / "events" / name).read_bytes())["outcome"] == "committed"
