"""A checkpoint of unknown origin executes nothing: not in `shardckpt` commands, not in a load.

A crafted `.metadata` whose pickle calls `os.system` (creating a marker file) is refused by verify,
inspect-style commands and load, and the marker never appears. `.metadata`'s bytes are checked against
the manifest (v2) before unpickling; a v1 checkpoint still loads, and its `.metadata` still goes
through the allow-list. Objects in a state dict are refused by class name unless the caller trusts the
checkpoint. Paths in `.metadata` stay inside the checkpoint directory.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from lightning_shardckpt import CorruptCheckpoint, LoadConfig, UntrustedCheckpoint, load_checkpoint, verify_checkpoint
from lightning_shardckpt.engine.format import safe_pickle
from lightning_shardckpt.engine.format.names import DCP_METADATA, MANIFEST
from lightning_shardckpt.errors import ShardCkptError
from lightning_shardckpt.lightning import lightning_state
from lightning_shardckpt.ops.verify import DCP_METADATA_PROBLEM
from tests.helpers.checkpoints import fresh_state, save_checkpoint
from tests.helpers.forgery import forge_metadata

COMMIT_RECORD = "commit.json"  # format v2's listing record; a v1 checkpoint has none


class RunsCommand:
    """What an attacker pickles: unpickling it calls os.system(command)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class Opaque:
    """A harmless class of the user's own, not on any allow-list."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value


def make_v1(directory: str) -> None:
    """Rewrite a committed checkpoint as format v1 wrote it: no `.metadata` checksum, no commit record."""
    path = os.path.join(directory, MANIFEST)
    manifest = json.loads(Path(path).read_text())
    manifest["format_version"] = 1
    for field in (safe_pickle.DCP_METADATA_FIELD, "seq"):
        manifest.pop(field, None)
    os.remove(path)
    Path(path).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if os.path.exists(os.path.join(directory, COMMIT_RECORD)):
        os.remove(os.path.join(directory, COMMIT_RECORD))


def replace_metadata(directory: str, data: bytes) -> None:
    path = os.path.join(directory, DCP_METADATA)
    os.remove(path)  # write-once files: replaced, as an attacker with write access would
    Path(path).write_bytes(data)


@pytest.fixture
def crafted(tmp_path, committed_checkpoint):
    """A committed format-v2 checkpoint (whose readers unpickle `.metadata`) whose `.metadata` was replaced by a
    pickle that creates `marker`."""
    root, directory, _ = committed_checkpoint(format_version=2)
    marker = tmp_path / "pwned"
    replace_metadata(directory, pickle.dumps(RunsCommand(f"touch {marker}")))
    return root, directory, marker


def test_metadata_of_a_real_checkpoint_with_tensors_objects_and_rng_unpickles_through_the_allow_list(
    committed_checkpoint,
):
    state = fresh_state()
    state["extra"] = {
        "rng": torch.get_rng_state(),
        "blob": b"\x00\x01",
        "ints": torch.arange(5, dtype=torch.int64),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "plain": {"a": [1, 2.5, "x"], "t": (1, None)},
    }
    root, directory, manifest = committed_checkpoint(state=state)
    data = Path(directory, DCP_METADATA).read_bytes()
    metadata = safe_pickle.load_dcp_metadata(data, root, expected=manifest[safe_pickle.DCP_METADATA_FIELD])
    assert set(metadata.state_dict_metadata) == {t["fqn"] for t in manifest["tensors"]} | {
        o["fqn"] for o in manifest["objects"]
    }
    assert manifest[safe_pickle.DCP_METADATA_FIELD] == {"checksum": safe_pickle.checksum(data), "bytes": len(data)}


def test_verify_refuses_a_metadata_pickle_that_would_run_a_command_and_the_marker_never_appears(crafted, run_cli):
    root, directory, marker = crafted
    report = verify_checkpoint(root)  # v2: the recorded checksum catches the swap; the allow-list names the call
    assert [p["kind"] for p in report.problems] == [DCP_METADATA_PROBLEM] * 2
    assert report.problems[0]["actual"] == safe_pickle.checksum(Path(directory, DCP_METADATA).read_bytes())
    assert report.problems[1]["actual"] in ("posix.system", "os.system", "nt.system")
    assert not marker.exists()

    make_v1(directory)  # no checksum to compare: the allow-list alone must stop it, naming the global
    report = verify_checkpoint(root)
    assert [p["kind"] for p in report.problems] == [DCP_METADATA_PROBLEM]
    assert report.problems[0]["actual"] in ("posix.system", "os.system", "nt.system")
    code, out, _ = run_cli("verify", root)
    assert code == 1 and "system" in out
    assert not marker.exists()


def test_a_v4_load_never_reads_metadata_so_a_crafted_one_runs_nothing_and_verify_names_it(
    tmp_path, committed_checkpoint
):
    # format v4 plans each rank's load from the manifest and the parts: `.metadata` is there for plain DCP only
    root, directory, manifest = committed_checkpoint()
    marker = tmp_path / "pwned"
    replace_metadata(directory, pickle.dumps(RunsCommand(f"touch {marker}")))
    target = fresh_state(seed=99)
    load_checkpoint(target, root)
    assert torch.equal(target["model"]["0.weight"], fresh_state(seed=manifest["step"])["model"]["0.weight"])
    report = verify_checkpoint(root)
    assert [p["kind"] for p in report.problems] == [DCP_METADATA_PROBLEM] * 2
    assert report.problems[1]["actual"] in ("posix.system", "os.system", "nt.system")
    assert not marker.exists()


def test_ls_inspect_diff_and_timeline_never_unpickle_a_crafted_metadata(crafted, run_cli):
    root, directory, marker = crafted
    make_v1(directory)
    for argv in (["ls", root], ["inspect", root], ["timeline", root], ["diff", "--root", root, "latest", "latest"]):
        assert run_cli(*argv)[0] in (0, 1), argv
    assert not marker.exists()


def test_load_refuses_a_crafted_metadata_by_checksum_v2_and_by_class_v1_and_runs_nothing(crafted):
    root, directory, marker = crafted
    with pytest.raises(CorruptCheckpoint, match="altered after commit"):
        load_checkpoint(fresh_state(), root)
    make_v1(directory)
    with pytest.raises(CorruptCheckpoint, match=r"system.*never holds"):
        load_checkpoint(fresh_state(), root)
    assert not marker.exists()


def test_v1_checkpoint_without_a_metadata_checksum_still_loads(committed_checkpoint):
    root, directory, manifest = committed_checkpoint(format_version=2)
    make_v1(directory)
    target = fresh_state(seed=99)
    load_checkpoint(target, root)
    assert torch.equal(target["model"]["0.weight"], fresh_state(seed=manifest["step"])["model"]["0.weight"])


def test_metadata_pointing_outside_the_checkpoint_directory_is_corrupt_not_a_read(committed_checkpoint):
    root, directory, manifest = committed_checkpoint(format_version=2)
    make_v1(directory)
    metadata = safe_pickle.load_dcp_metadata(Path(directory, DCP_METADATA).read_bytes(), directory)
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = _StorageInfo("../../../../etc/passwd", info.offset, info.length)
    replace_metadata(directory, pickle.dumps(metadata))

    with pytest.raises(CorruptCheckpoint, match=r"etc/passwd.*outside the checkpoint directory"):
        load_checkpoint(fresh_state(), root)
    report = verify_checkpoint(root)
    assert any(p["kind"] == DCP_METADATA_PROBLEM and "etc/passwd" in str(p["actual"]) for p in report.problems)


def test_a_shard_that_is_a_symlink_out_of_the_directory_is_never_read(tmp_path, committed_checkpoint):
    root, directory, manifest = committed_checkpoint()
    shard = os.path.join(directory, manifest["files"][0]["path"])
    outside = tmp_path / "elsewhere.distcp"
    os.replace(shard, outside)
    os.symlink(outside, shard)

    with pytest.raises(CorruptCheckpoint, match="outside the checkpoint directory"):
        load_checkpoint(fresh_state(), root)
    assert not verify_checkpoint(root).ok


def test_an_object_of_a_class_outside_the_allow_list_is_refused_by_name_unless_trusted(tmp_path):
    root = str(tmp_path / "ckpt")
    state = fresh_state()
    state["user"] = Opaque(7)
    save_checkpoint(root, state=state)

    target = fresh_state(seed=5)
    target["user"] = None
    with pytest.raises(UntrustedCheckpoint, match=r"Opaque.*trust_checkpoint=True.*add_safe_globals") as caught:
        load_checkpoint(target, root)
    assert caught.value.blocked.endswith("test_untrusted_checkpoints.Opaque")
    load_checkpoint(target, root, config=LoadConfig(trust_checkpoint=True))
    assert target["user"] == Opaque(7)

    target["user"] = None
    torch.serialization.add_safe_globals([Opaque])  # the narrower fix the error names
    try:
        load_checkpoint(target, root)
    finally:
        torch.serialization.clear_safe_globals()
    assert target["user"] == Opaque(7)


def test_an_object_that_would_run_a_command_is_refused_and_the_marker_never_appears(tmp_path):
    root = str(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    state = fresh_state()
    state["user"] = RunsCommand(f"touch {marker}")
    save_checkpoint(root, state=state)
    assert not marker.exists()
    target = fresh_state(seed=5)
    target["user"] = None
    with pytest.raises(UntrustedCheckpoint, match="system"):
        load_checkpoint(target, root)
    assert not marker.exists()


def test_lightning_blob_with_a_blocked_class_names_it_the_checkpoint_and_the_fix():
    rest = {"hyper_parameters": {"lr": 0.1}, "callbacks": {"x": Opaque(1)}, "t": torch.ones(2), "s": torch.Size([2])}
    loaded = {
        lightning_state.LIGHTNING_KEY: lightning_state.to_dcp_state({"state_dict": {}, **rest})[
            lightning_state.LIGHTNING_KEY
        ]
    }
    with pytest.raises(
        UntrustedCheckpoint, match=r"/ckpt/step-1: .*test_untrusted_checkpoints\.Opaque.*trust_checkpoint=True"
    ):
        lightning_state.lightning_rest(loaded, where="/ckpt/step-1")
    trusted = lightning_state.lightning_rest(loaded, trust=True)
    assert trusted["callbacks"]["x"] == Opaque(1)


def test_lightning_blob_of_plain_state_tensors_and_hparams_loads_with_trust_off():
    from lightning.fabric.utilities.data import AttributeDict

    rest = {
        "hyper_parameters": AttributeDict(lr=0.1, name="x"),
        "loops": {"fit_loop": {"epoch": 1}},
        "rng": torch.get_rng_state(),
        "dtype": torch.bfloat16,
        "size": torch.Size([3]),
    }
    blob = lightning_state.to_dcp_state({"state_dict": {}, **rest})[lightning_state.LIGHTNING_KEY]
    loaded = lightning_state.lightning_rest({lightning_state.LIGHTNING_KEY: blob})
    assert loaded["hyper_parameters"] == {"lr": 0.1, "name": "x"}
    assert torch.equal(loaded["rng"], rest["rng"]) and loaded["dtype"] is torch.bfloat16


def test_blocked_global_names_module_and_qualname():
    with pytest.raises(safe_pickle.BlockedGlobal) as caught:
        safe_pickle.loads(pickle.dumps(Opaque(1)))
    assert caught.value.name == f"{__name__}.Opaque"
    with pytest.raises(safe_pickle.BlockedGlobal):
        safe_pickle.RestrictedUnpickler(
            io.BytesIO(pickle.dumps(RunsCommand("true"))), safe_pickle.DCP_METADATA_GLOBALS
        ).load()


def test_lightning_blob_with_hydra_containers_in_hparams_loads_with_trust_off():
    from lightning.fabric.utilities.data import AttributeDict
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"model": {"betas": [0.9, 0.95], "lr": 0.003, "name": "${model.lr}"}})
    rest = {"hyper_parameters": AttributeDict(betas=cfg.model.betas, model=cfg.model), "hparams_name": "kwargs"}
    blob = lightning_state.to_dcp_state({"state_dict": {}, **rest})[lightning_state.LIGHTNING_KEY]
    loaded = lightning_state.lightning_rest({lightning_state.LIGHTNING_KEY: blob})
    assert list(loaded["hyper_parameters"]["betas"]) == [0.9, 0.95]
    assert loaded["hyper_parameters"]["model"].name == 0.003


def test_manifest_naming_a_file_outside_the_checkpoint_directory_is_corrupt_not_a_read(committed_checkpoint, run_cli):
    root, directory, manifest = committed_checkpoint(format_version=2)
    make_v1(directory)
    path = os.path.join(directory, MANIFEST)
    edited = json.loads(Path(path).read_text())
    escaped = "../../../../../../etc/passwd"
    for item in (edited["files"][0], *edited["objects"], *(c for t in edited["tensors"] for c in t["chunks"])):
        key = "path" if "path" in item else "file"
        item[key] = escaped
    os.remove(path)
    Path(path).write_text(json.dumps(edited))

    with pytest.raises(ShardCkptError, match=r"etc/passwd"):
        load_checkpoint(fresh_state(), directory)
    code, _, err = run_cli("verify", directory)
    assert code == 2 and "etc/passwd" in err


def test_a_part_naming_a_file_outside_the_checkpoint_directory_is_corrupt_not_a_read(committed_checkpoint, run_cli):
    # format v4: a part names its shard file; one naming a path out of the directory, with every checksum that
    # vouches for it rewritten, is refused before anything is opened
    from tests.helpers.forgery import forge_part

    root, directory, _ = committed_checkpoint()
    forge_part(directory, 0, lambda part: part.update(file="../../../../../../etc/passwd"))
    with pytest.raises(ShardCkptError, match=r"etc/passwd.*not a relative path inside"):
        load_checkpoint(fresh_state(), directory)
    code, out, _ = run_cli("verify", directory)
    assert code == 1 and "etc/passwd" in out


# A 12-byte pickle: GLOBAL builtins.bytearray, BININT 1 GiB, TUPLE1, REDUCE, STOP. Unpickled freely it
# zero-fills a gigabyte before anything can tell it is not DCP metadata.
GIGABYTE = 1 << 30
BYTEARRAY_OF_A_GIGABYTE = (
    b"\x80\x02cbuiltins\nbytearray\nJ" + GIGABYTE.to_bytes(4, "little") + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP
)
SIZED_CALLS = {  # every allow-listed callable that allocates by a size argument, called with one
    "bytearray": b"cbuiltins\nbytearray\n",
    "bytes": b"cbuiltins\nbytes\n",
    "FloatStorage": b"ctorch\nFloatStorage\n",
    "UntypedStorage": b"ctorch.storage\nUntypedStorage\n",
    "LongTensor": b"ctorch\nLongTensor\n",
}
RSS_PROBE = """
import resource, sys
import torch
from lightning_shardckpt import load_checkpoint, verify_checkpoint
from lightning_shardckpt.cli.main import main
from tests.helpers.checkpoints import fresh_state

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux

root = sys.argv[1]
verify_checkpoint(root)  # warm: imports and caches are not what is measured
before = peak_mib()
problems = [p["actual"] for p in verify_checkpoint(root).problems]
try:
    load_checkpoint(fresh_state(), root)
    refused = "loaded"
except Exception as err:
    refused = f"{type(err).__name__}: {err}"
code = main(["verify", root])
print("RESULT", round(peak_mib() - before), code, problems, refused, sep="\\n")
"""


def run_rss_probe(root: str) -> tuple[float, int, str, str]:
    """verify, load and `shardckpt verify` of `root` in a fresh process: (peak RSS growth MiB, exit code,
    verify's problems, the load's error)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, root], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert "RESULT" in done.stdout, done.stderr[-3000:]
    growth, code, problems, refused = done.stdout.split("RESULT\n", 1)[1].splitlines()[:4]
    return float(growth), int(code), problems, refused


@pytest.mark.slow
@pytest.mark.parametrize("version", ["v1-no-checksum", "v2-checksums-rewritten"])
def test_a_metadata_pickle_asking_for_a_gigabyte_is_refused_without_allocating_it(committed_checkpoint, version):
    root, directory, _ = committed_checkpoint(format_version=2)
    if version == "v1-no-checksum":
        make_v1(directory)
        replace_metadata(directory, BYTEARRAY_OF_A_GIGABYTE)
    else:  # an attacker who rewrites the manifest's checksum of `.metadata` and the commit record too
        forge_metadata(directory, BYTEARRAY_OF_A_GIGABYTE)
    growth, code, problems, refused = run_rss_probe(root)
    assert growth < 64, f"peak RSS grew by {growth} MiB while refusing a {len(BYTEARRAY_OF_A_GIGABYTE)}-byte .metadata"
    assert code == 1 and "bytearray" in problems
    assert refused.startswith("CorruptCheckpoint") and "builtins.bytearray" in refused and str(GIGABYTE) in refused


@pytest.mark.parametrize("name", sorted(SIZED_CALLS))
def test_no_allow_listed_callable_allocates_more_than_the_pickle_holds(name):
    data = b"\x80\x02" + SIZED_CALLS[name] + b"J" + GIGABYTE.to_bytes(4, "little") + pickle.TUPLE1 + pickle.REDUCE
    data += pickle.STOP
    with pytest.raises(safe_pickle.OversizedAllocation, match=rf"{name}.*{GIGABYTE}.*{len(data)}-byte"):
        safe_pickle.loads(data, safe_pickle.LIGHTNING_STATE_GLOBALS)
    if name == "bytearray":
        with pytest.raises(CorruptCheckpoint, match=rf"bytearray.*{GIGABYTE}.*crafted"):
            safe_pickle.load_dcp_metadata(data, "/ckpt/step-1")


def test_small_sizes_and_real_bytes_still_unpickle_through_the_allow_list():
    assert safe_pickle.loads(pickle.dumps(bytearray(b"abc"), protocol=4)) == bytearray(b"abc")
    empty_bytes = (
        b"\x80\x02cbuiltins\nbytes\n" + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP
    )  # how protocol 2 pickles b""
    assert safe_pickle.loads(empty_bytes, safe_pickle.LIGHTNING_STATE_GLOBALS) == b""
    assert torch.equal(safe_pickle.loads(pickle.dumps(torch.arange(4))), torch.arange(4))
