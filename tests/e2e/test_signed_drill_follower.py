"""`shardckpt drill --follow --public-key`: the follower refuses a checkpoint that fails the signature policy (a
forged one, an unsigned one) with a failed drill record naming the file and the key, without crashing and without
forking a drill; it drills the validly signed ones, which become known-good. The drill ranks check the files they
read against the signed digests: a shard file changed outside every chunk (no checksum sees it) passes a drill
without keys and fails one with them."""

from __future__ import annotations

import os
import signal

from lightning_shardckpt.engine.config import SignConfig
from lightning_shardckpt.engine.format import drill_records
from lightning_shardckpt.engine.format.names import shard_filename
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.forgery import forge_tensor_values
from tests.unit.test_signing import FORGED, FQN, make_key, save


def _records(root: str) -> dict[str, dict]:
    """Each checkpoint's newest drill record, by directory name."""
    location = fsio.resolve(root)
    return {
        name: drill_records.read_record(location, names[-1])
        for name, names in drill_records.list_record_names(location).items()
    }


def test_follower_with_a_public_key_records_forged_and_unsigned_checkpoints_and_drills_the_signed(tmp_path, run_cli):
    private, public, _ = make_key(tmp_path, "writer")
    root = str(tmp_path / "root")
    sign = SignConfig(key_path=private)
    save(root, 1, sign)
    forged = os.path.basename(save(root, 2, sign))
    forge_tensor_values(fsio.resolve(root), os.path.join(root, forged), FQN, FORGED)

    follow = ("drill", "--follow", "--once", "--interval", "0.1", "--public-key", public, root)
    sigterm_before = signal.getsignal(signal.SIGTERM)
    code, out, err = run_cli(*follow)
    assert code == 0, err  # refused and recorded: the follower goes on
    assert signal.getsignal(signal.SIGTERM) is sigterm_before  # put back: this process's SIGTERM acts as before
    record = _records(root)[forged]
    assert record["verdict"] == drill_records.FAILED and record["signature_refused"], record
    assert "manifest.json: its signature by key" in record["cause"]
    assert "worker_pool" not in record  # refused before any drill rank was forked

    signed = os.path.basename(save(root, 3, sign))
    code, out, err = run_cli(*follow)
    assert code == 0, err
    record = _records(root)[signed]
    assert record["verdict"] == drill_records.PASSED, record
    assert len(record["signed_by"]) == 64  # the accepting key's id, recorded with the pass

    unsigned = os.path.basename(save(root, 4))
    code, out, err = run_cli(*follow)
    assert code == 0, err
    record = _records(root)[unsigned]
    assert record["verdict"] == drill_records.FAILED and "missing; the checkpoint is unsigned" in record["cause"]
    code, out, _ = run_cli("last-good", root)
    assert code == 0 and signed in out  # only the validly signed one is known-good


def test_drill_ranks_check_the_files_they_read_against_the_signed_digests(tmp_path, run_cli):
    private, public, _ = make_key(tmp_path, "writer")
    root = str(tmp_path / "root")
    directory = save(root, 1, SignConfig(key_path=private))
    shard = os.path.join(directory, shard_filename(0))
    os.chmod(shard, 0o644)
    with open(shard, "ab") as handle:  # after every chunk: no xxh3 checksum covers these bytes, the digest does
        handle.write(b"appended by someone without the key")

    code, out, err = run_cli("drill", directory)
    assert code == 0, (out, err)  # checksums alone cannot tell
    code, out, err = run_cli("drill", directory, "--public-key", public)
    assert code == 1, (out, err)  # the manifest's signature holds; the ranks' digest check fails the drill
    newest = sorted(_records(root).values(), key=lambda record: record["started_at"])[-1]
    assert newest["verdict"] == drill_records.FAILED
    assert "__0_0.distcp: its" in newest["cause"] and "digest differs" in newest["cause"], newest["cause"]
