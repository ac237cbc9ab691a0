"""Opening any file of a checkpoint allocates at most a small multiple of that file's size (issue 37, item 4).

Memory bombs in checkpoints that are otherwise safe to open, each on real files: a 1,261-byte object record that
reduces to `bytearray(384 MiB)`; a `.metadata` that asks for `bytearray(49 KB)` thousands of times (each call
below a per-call bound, the total quadratic), encodes one memo'd string thousands of times, or BUILDs thousands
of objects from one memo'd state dict; a torch.save record whose deflated zip entry unpacks to far more than the
record; a manifest padded with `[{}, {}, ...]`; a manifest and `.metadata` that agree on a 1 GiB chunk in an 8 KB
file. Every reader (load, drill, verify, inspect, timeline, export) refuses them by name; the peak memory of a
fresh process doing so is measured (ru_maxrss), never mocked.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_shardckpt import CorruptCheckpoint, UntrustedCheckpoint, load_checkpoint, verify_checkpoint
from lightning_shardckpt.engine.format import bounded_json, safe_pickle
from lightning_shardckpt.engine.format.pickle_allowance import FACTOR
from tests.helpers.checkpoints import fresh_state
from tests.helpers.forgery import forge_chunk_length, forge_manifest, forge_metadata

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
LIE = 1 << 30  # the chunk length a lying manifest claims


class Bomb:
    """What an attacker pickles as an object: unpickling it zero-fills 384 MiB."""

    def __reduce__(self):
        return bytearray, (384 * MIB,)


def repeated_bytearrays(count: int = 8327, size: int = 49 << 10) -> bytes:
    """A ~75 KB pickle calling bytearray(49 KB) `count` times: ~400 MB if each call is bounded on its own."""
    call = b"h\x00J" + size.to_bytes(4, "little") + pickle.TUPLE1 + pickle.REDUCE
    return b"\x80\x02cbuiltins\nbytearray\nq\x00" + pickle.MARK + call * count + pickle.TUPLE + pickle.STOP


def repeated_encodes(count: int = 8327, size: int = 49 << 10) -> bytes:
    """`_codecs.encode` (how protocol 2 pickles bytes) of one memo'd 49 KB string, `count` times."""
    text = b"x" * size
    head = (
        b"\x80\x02c_codecs\nencode\nq\x00X" + size.to_bytes(4, "little") + text + b"q\x01X\x06\x00\x00\x00latin1q\x02"
    )
    call = b"h\x00h\x01h\x02" + pickle.TUPLE2 + pickle.REDUCE
    return head + pickle.MARK + call * count + pickle.TUPLE + pickle.STOP


def repeated_builds(entries: int = 20_000, objects: int = 2_000) -> bytes:
    """DCP's `_StorageInfo` built `objects` times from one memo'd state dict of `entries` keys (~1 MB each copy)."""
    keys = b"".join(b"X\x07\x00\x00\x00" + f"k{i:06d}".encode() + b"K\x00" for i in range(entries))
    state = pickle.EMPTY_DICT + b"q\x01" + pickle.MARK + keys + pickle.SETITEMS
    build = b"h\x00" + pickle.EMPTY_TUPLE + pickle.NEWOBJ + b"h\x01" + pickle.BUILD
    cls = b"ctorch.distributed.checkpoint.filesystem\n_StorageInfo\nq\x00"
    return b"\x80\x02" + cls + state + pickle.POP + pickle.MARK + build * objects + pickle.TUPLE + pickle.STOP


METADATA_BOMBS = {"bytearray": repeated_bytearrays, "encode": repeated_encodes, "build": repeated_builds}
REFUSED_CALL = {  # what the refusal names for each
    "bytearray": "builtins.bytearray(",
    "encode": "_codecs.encode(",
    "build": "torch.distributed.checkpoint.filesystem._StorageInfo(",
}

# A fresh process opens each root in turn; growth of its peak RSS (kilobytes on Linux) while doing so, per root.
PEAK_PROBE = """
import json, resource, sys
from lightning_shardckpt import load_checkpoint, verify_checkpoint
from lightning_shardckpt.cli.main import main
from tests.helpers.checkpoints import fresh_state

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def load(root, user=False):
    target = fresh_state()
    if user:
        target["user"] = None  # the object the checkpoint holds
    load_checkpoint(target, root)

actions = {"verify": lambda root: main(["verify", root]), "inspect": lambda root: main(["inspect", root]),
           "timeline": lambda root: main(["timeline", root]), "load": load, "load-object": lambda root: load(root, True),
           "export": lambda root: main(["export", root, root + "-export.pt", "--replace"])}
main(["verify", sys.argv[1]])  # warm: imports and caches are not what is measured
out = []
for action, root in json.loads(sys.argv[2]):
    before = peak()
    try:
        outcome = f"exit {actions[action](root)}"
    except Exception as err:
        outcome = f"{type(err).__name__}: {err}"
    out.append([action, root, round(peak() - before), outcome])
print("RESULT" + json.dumps(out))
"""


def peak_growth(warm_root: str, actions: list[tuple[str, str]]) -> list[tuple[str, str, int, str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", PEAK_PROBE, warm_root, json.dumps(actions)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert "RESULT" in done.stdout, done.stderr[-3000:]
    return [tuple(row) for row in json.loads(done.stdout.split("RESULT", 1)[1])]


@pytest.fixture
def bombs(tmp_path, committed_checkpoint):
    """Roots holding one good checkpoint or one bomb each, by name."""
    roots = {"good": committed_checkpoint(tmp_path / "good").root}
    state = fresh_state()
    state["user"] = Bomb()
    roots["object"] = committed_checkpoint(tmp_path / "object", state=state).root
    for name, make in METADATA_BOMBS.items():
        # format v2: our v4 readers plan from the parts and never unpickle .metadata (only a plain dcp.load does)
        committed = committed_checkpoint(tmp_path / f"metadata-{name}", format_version=2)
        forge_metadata(committed.directory, make())
        roots[f"metadata-{name}"] = committed.root
    padded = committed_checkpoint(tmp_path / "manifest")
    forge_manifest(padded.directory, lambda manifest: manifest.update({"padding": [{}] * (5 * MIB)}))
    roots["manifest"] = padded.root
    for kind, fqn in (("object", "progress.global_step"), ("tensor", "model.0.bias")):  # read buffered / direct
        # v2: the lie reaches the read (v4 refuses it earlier: a part's chunks must tile its shard file)
        lying = committed_checkpoint(tmp_path / f"lying-{kind}", format_version=2)
        forge_chunk_length(lying.directory, fqn, LIE)
        roots[f"lying-{kind}"] = lying.root
    lying = committed_checkpoint(tmp_path / "lying-v4")
    forge_chunk_length(lying.directory, "model.0.bias", LIE)
    roots["lying-v4"] = lying.root
    return roots


@pytest.mark.slow
def test_no_reader_allocates_more_than_a_small_multiple_of_the_file_it_opens(bombs):
    actions = [("load-object", bombs["object"])]
    actions += [(action, bombs[f"metadata-{name}"]) for name in METADATA_BOMBS for action in ("verify", "load")]
    actions += [(action, bombs["manifest"]) for action in ("verify", "inspect", "timeline")]
    actions += [
        (action, bombs[f"lying-{kind}"]) for kind in ("object", "tensor") for action in ("verify", "load", "export")
    ]
    actions += [(action, bombs["lying-v4"]) for action in ("verify", "load", "export")]
    rows = peak_growth(bombs["good"], actions)
    for action, root, growth, outcome in rows:
        assert growth < 64, f"{action} {root}: peak RSS grew by {growth} MiB ({outcome})"
    outcomes = {(action, Path(root).name): outcome for action, root, _, outcome in rows}
    refused = outcomes[("load-object", "object")]
    assert refused.startswith("UntrustedCheckpoint") and "builtins.bytearray" in refused
    for name in METADATA_BOMBS:
        assert outcomes[("verify", f"metadata-{name}")] == "exit 1"
        assert outcomes[("load", f"metadata-{name}")].startswith("CorruptCheckpoint")
    for action in ("verify", "inspect"):
        assert outcomes[(action, "manifest")] == "exit 2"  # the one checkpoint there is corrupt: nothing to read
    assert outcomes[("timeline", "manifest")] == "exit 0"  # its row says corrupt, with the reason
    for kind in ("object", "tensor"):  # the shard file holds 8 KB whatever the manifest says: a short read
        assert outcomes[("verify", f"lying-{kind}")] == "exit 1"
        assert (
            outcomes[("load", f"lying-{kind}")].startswith("CorruptCheckpoint")
            and f"of {LIE} bytes" in outcomes[("load", f"lying-{kind}")]
        )
    assert outcomes[("export", "lying-tensor")] == "exit 2"
    assert outcomes[("verify", "lying-v4")] == "exit 1" and outcomes[("export", "lying-v4")] == "exit 2"
    assert (
        outcomes[("load", "lying-v4")].startswith("CorruptCheckpoint")
        and "in no chunk" in outcomes[("load", "lying-v4")]
    )


@pytest.mark.parametrize("name", sorted(METADATA_BOMBS))
def test_a_metadata_whose_calls_together_ask_too_much_is_corrupt_naming_the_call(bombs, name):
    report = verify_checkpoint(bombs[f"metadata-{name}"])
    assert not report.ok and report.problems[0]["kind"] == "dcp_metadata"
    assert report.problems[0]["actual"].startswith(REFUSED_CALL[name])
    with pytest.raises(CorruptCheckpoint, match=rf"over the \d+ bytes it may \({FACTOR}x its size\).*crafted"):
        load_checkpoint(fresh_state(), bombs[f"metadata-{name}"])


def test_an_object_record_asking_for_384_mib_is_refused_naming_the_call_unless_trusted(bombs):
    target = fresh_state()
    target["user"] = None
    with pytest.raises(UntrustedCheckpoint, match=r"'user'.*builtins\.bytearray asks for 402653184 .*1261-byte"):
        load_checkpoint(target, bombs["object"])


def test_a_padded_manifest_is_corrupt_in_every_reader_and_verify_never_says_ok(bombs, run_cli):
    code, out, _ = run_cli("ls", bombs["manifest"], "--json")
    assert code == 0  # ls reads the commit record only; opening the manifest is what refuses it
    for command in ("verify", "inspect"):
        code, out, err = run_cli(command, bombs["manifest"])
        assert code == 2 and "OK" not in out and "padded or crafted" in err
    with pytest.raises(Exception, match="padded or crafted"):
        load_checkpoint(fresh_state(), bombs["manifest"])


def test_real_checkpoints_still_open_in_every_reader(bombs, run_cli):
    assert verify_checkpoint(bombs["good"]).ok
    for command in ("verify", "inspect", "timeline"):
        code, _, err = run_cli(command, bombs["good"])
        assert code == 0, err
    code, _, err = run_cli("export", bombs["good"], bombs["good"] + "-export.pt")
    assert code == 0, err
    load_checkpoint(fresh_state(), bombs["good"])


def test_a_torch_record_whose_zip_entry_unpacks_to_more_than_the_record_is_refused():
    buffer = io.BytesIO()
    torch.save({"x": "a" * 100}, buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w") as out:
        for info in source.infolist():
            body = source.read(info.filename)
            if info.filename.endswith("data.pkl"):  # a pickle of a 64 MiB string, deflated to ~64 KB
                body = pickle.dumps({"x": "a" * (64 * MIB)}, protocol=2)
            out.writestr(info.filename, body, compress_type=zipfile.ZIP_DEFLATED)
    data = packed.getvalue()
    assert len(data) < MIB
    with pytest.raises(safe_pickle.OversizedAllocation, match="zip entries"):
        safe_pickle.load_torch_record(data)
    with pytest.raises(UntrustedCheckpoint, match="zip entries"):
        safe_pickle.load_object_record(data, "user", "/ckpt/step-1")


def test_json_denser_than_any_file_we_write_is_refused_before_parsing():
    padded = b"[" + b"{}," * (MIB // 2) + b"{}]"
    with pytest.raises(bounded_json.UnreadableJson, match="padded or crafted"):
        bounded_json.loads(padded, bounded_json.MANIFEST_MAX_BYTES)
    small = b"[" + b"{}," * 1000 + b"{}]"  # below SMALL_DOCUMENT: harmless whatever its density
    assert len(bounded_json.loads(small, bounded_json.SMALL_MAX_BYTES)) == 1001
    strings = json.dumps({"blocks": [f"{i:016x}" for i in range(MIB // 8)]}).encode()  # what block checksums look like
    assert len(bounded_json.loads(strings, bounded_json.MANIFEST_MAX_BYTES)["blocks"]) == MIB // 8


@pytest.mark.slow
def test_a_restore_drill_fails_the_object_bomb_naming_the_call(bombs):
    from lightning_shardckpt.policies.drills.runner import DrillOptions, run_drill

    record = run_drill(bombs["object"], DrillOptions(world_size=1, timeout_s=120))
    assert record["verdict"] == "failed" and "builtins.bytearray asks for 402653184" in record["cause"]
