"""The `shardckpt` command: ls / inspect / verify, in-process through `main` and once as the installed script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lightning_shardckpt.engine.format.manifest import files_of
from lightning_shardckpt.engine.format.names import checkpoint_dirname
from tests.helpers.checkpoints import PART, SHARD, chunk_of, dirnames_at_step, save_checkpoint

UNCOMMITTED = checkpoint_dirname(9, "deadbeefcafe")


@pytest.fixture
def root(tmp_path):
    """Two committed checkpoints (steps 3, 5) and a newer uncommitted directory (step 9) left by a crash."""
    path = str(tmp_path / "run")
    save_checkpoint(path, step=3)
    save_checkpoint(path, step=5)
    os.makedirs(os.path.join(path, UNCOMMITTED))
    with open(os.path.join(path, UNCOMMITTED, SHARD), "wb") as handle:
        handle.write(b"half a shard")
    return path


def latest_dir(root: str) -> str:
    names = dirnames_at_step(os.listdir(root), 5)
    return os.path.join(root, names[0])


def test_ls_json_lists_committed_and_uncommitted_and_marks_latest(root, run_cli):
    code, out, _ = run_cli("ls", root, "--json")
    assert code == 0
    listing = json.loads(out)
    rows = {row["step"]: row for row in listing["checkpoints"]}
    assert sorted(rows) == [3, 5, 9]
    assert [rows[s]["state"] for s in (3, 5, 9)] == ["committed", "committed", "uncommitted"]
    # the newer uncommitted directory is never latest
    assert [s for s, row in rows.items() if row["latest"]] == [5]
    assert listing["latest"] == os.path.basename(latest_dir(root))
    assert rows[9]["id"] == "deadbeefcafe" and rows[9]["bytes"] == len(b"half a shard")
    assert all(row["age_s"] is not None and row["age_s"] >= 0 for row in rows.values())
    # its own files: the shard and (format v4) the part that records its chunks
    assert rows[5]["bytes"] == sum(os.path.getsize(os.path.join(latest_dir(root), name)) for name in (SHARD, PART))


def test_ls_prints_a_table_with_state_and_latest_marker(root, run_cli):
    code, out, _ = run_cli("ls", root)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "ID", "STATE", "TRUST", "SIZE", "REFERENCED", "AGE", "LATEST", "NAME"]
    by_step = {line.split()[0]: line for line in lines[1:]}
    assert "uncommitted" in by_step["9"] and "*" not in by_step["9"]
    assert by_step["5"].split()[3] == "committed"  # committed, never drilled
    assert " * " in by_step["5"] and " * " not in by_step["3"]


def test_inspect_json_summarises_the_latest_manifest(root, run_cli):
    code, out, _ = run_cli("inspect", root, "--json")
    assert code == 0
    summary = json.loads(out)
    manifest = json.load(open(os.path.join(latest_dir(root), "manifest.json")))
    assert (summary["id"], summary["step"], summary["parent"]) == (manifest["id"], 5, manifest["parent"])
    assert summary["parent"] is not None  # step 3's id
    assert summary["files"] == {"count": 2, "bytes": sum(f["bytes"] for f in files_of(manifest))}  # shard, part
    assert (summary["tensors"], summary["objects"]) == (len(manifest["tensors"]), len(manifest["objects"]))
    assert summary["topology"]["world_size"] == 1
    assert summary["verification"] == manifest["verification"]
    assert summary["identity"]["keys"] == ["code", "config", "data", "model", "run"]
    # a checkpoint directory names itself
    code, out, _ = run_cli("inspect", latest_dir(root), "--json")
    assert json.loads(out)["id"] == manifest["id"]


def test_verify_exits_0_on_a_sound_checkpoint(root, run_cli):
    code, out, _ = run_cli("verify", os.path.join(root, "latest"))
    assert code == 0
    assert out.startswith("OK ") and os.path.basename(latest_dir(root)) in out


def test_verify_exits_1_and_names_the_bad_tensor_and_file(root, run_cli):
    directory = latest_dir(root)
    manifest = json.load(open(os.path.join(directory, "manifest.json")))
    chunk = chunk_of(manifest, "model.2.bias", directory)
    with open(os.path.join(directory, SHARD), "r+b") as handle:
        handle.seek(chunk["offset"] + chunk["length"] - 3)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x80]))

    code, out, _ = run_cli("verify", os.path.join(root, "latest"))
    assert code == 1
    assert out.startswith("CORRUPT ")
    bad_rows = [line for line in out.splitlines() if "chunk_checksum" in line]
    assert len(bad_rows) == 1 and "model.2.bias" in bad_rows[0] and SHARD in bad_rows[0]
    assert chunk["checksum"] in bad_rows[0]

    code, out, _ = run_cli("verify", directory, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    assert {"kind": "chunk_checksum", "file": SHARD, "tensor": "model.2.bias"}.items() <= report["problems"][0].items()


def test_verify_of_a_missing_path_exits_2_with_one_line_and_no_traceback(tmp_path, run_cli):
    code, out, err = run_cli("verify", str(tmp_path / "nope"))
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("shardckpt: error: ") and "Traceback" not in err


def test_an_uncommitted_directory_is_refused_with_exit_2(root, run_cli):
    code, _, err = run_cli("verify", os.path.join(root, UNCOMMITTED))
    assert code == 2
    assert "uncommitted" in err and len(err.strip().splitlines()) == 1


def test_storage_options_reach_fsspec_and_malformed_ones_are_rejected(root, run_cli):
    # LocalFileSystem accepts auto_mkdir; a JSON value keeps its type (false, not "false")
    code, out, _ = run_cli("ls", root, "--json", "--storage-option", "auto_mkdir=false")
    assert code == 0 and json.loads(out)["latest"]
    code, _, err = run_cli("ls", root, "--storage-option", "no-equals-sign")
    assert code == 2 and "KEY=VALUE" in err


@pytest.mark.slow  # runs the installed script: a fresh Python process (imports torch), ~4 s
def test_installed_shardckpt_script_verifies_and_prints_json(root):
    script = os.path.join(os.path.dirname(sys.executable), "shardckpt")
    done = subprocess.run([script, "verify", f"{root}/latest", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["step"] == 5 and report["files"] == 2  # the shard and its part


def test_ls_timeline_and_last_good_show_trust_from_drill_records(root, run_cli):
    # records as a drill files them (the drill itself is tested in tests/distributed/test_restore_drill.py)
    from lightning_shardckpt.engine.format import drill_records
    from lightning_shardckpt.engine.storage.fsio import resolve

    listing = json.loads(run_cli("ls", root, "--json")[1])
    names = {row["step"]: row["name"] for row in listing["checkpoints"]}
    assert run_cli("last-good", root)[0] == 2  # nothing drilled yet: an error that says how to drill
    location = resolve(root)
    for step, verdict in ((3, "passed"), (5, "failed")):
        drill_records.write_record(
            location,
            {
                "checkpoint": names[step],
                "drill_id": drill_records.new_drill_id(),
                "verdict": verdict,
                "cause": None if verdict == "passed" else "probe moved",
            },
        )
    rows = {row["step"]: row for row in json.loads(run_cli("ls", root, "--json")[1])["checkpoints"]}
    assert (rows[3]["trust"], rows[5]["trust"], rows[9]["trust"]) == ("drilled", "drill-failed", None)
    assert rows[3]["last_good"] and not rows[5]["last_good"] and rows[5]["latest"]
    code, out, _ = run_cli("last-good", root)
    assert code == 0 and out.strip().endswith(names[3])
    timeline = {
        row["step"]: row for row in json.loads(run_cli("timeline", root, "--json")[1])["checkpoints"] if row["name"]
    }
    assert (timeline[3]["trust"], timeline[3]["last_good"], timeline[5]["trust"]) == ("drilled", True, "drill-failed")
    assert "drilled (last good)" in run_cli("timeline", root)[1]


# --- errors while a command runs: one line, exit 2 (could not run), never 1 (found a problem) ---
def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardckpt: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "content, named",
    [
        ("rules:\n  - name: x\n    metric: [unclosed\n", ("ParserError",)),
        (
            "rules:\n  - name: x\n    metric: pause_s\n    owner: me\n    range: {kind: learned, warmup: ten}\n",
            ("warmup", "TypeError"),  # the field once the rule validator names it; the type error until then
        ),
    ],
    ids=["yaml-syntax", "string-warmup"],
)
def test_a_health_rules_file_that_cannot_be_used_exits_2_with_one_line_naming_the_file(
    root, tmp_path, run_cli, content, named
):
    rules = tmp_path / "bad.yaml"
    rules.write_text(content)
    code, _, err = run_cli("health", root, "--rules", rules)
    assert code == 2, "exit 1 would read as 'a rule fires' to cron and CI"
    line = _one_error_line(err)
    assert str(rules) in line and any(word in line for word in named), line


def test_a_bisect_check_that_raises_exits_2_not_1_which_means_a_bad_checkpoint_was_found(root, run_cli):
    code, _, err = run_cli("bisect", root, "--bad", "tests.helpers.bisect_checks:crashes")
    assert code == 2
    line = _one_error_line(err)
    assert "this check has a bug" in line and "ValueError" in line


def test_debug_prints_the_traceback_of_an_error_and_still_exits_2(root, run_cli, monkeypatch):
    code, _, err = run_cli("--debug", "bisect", root, "--bad", "tests.helpers.bisect_checks:crashes")
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("shardckpt: error: ")
    monkeypatch.setenv("SHARDCKPT_DEBUG", "1")
    code, _, err = run_cli("bisect", root, "--bad", "tests.helpers.bisect_checks:crashes")
    assert code == 2 and "Traceback" in err


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """No credentials anywhere botocore looks (environment, files, instance metadata)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _s3_options(server, *credentials: str) -> list[str]:
    options = [f"endpoint_url={server.endpoint}", 'client_kwargs={"region_name": "us-east-1"}', *credentials]
    return [arg for option in options for arg in ("--storage-option", option)]


@pytest.mark.parametrize("command", ["ls", "verify", "gc", "health", "timeline"])
def test_s3_without_credentials_exits_2_with_one_line_naming_the_fix(
    s3_server, s3_root, no_aws_credentials, run_cli, command
):
    code, out, err = run_cli(command, s3_root.url, *_s3_options(s3_server))
    assert code == 2 and out == ""
    line = _one_error_line(err)
    assert "credentials" in line and "AWS_ACCESS_KEY_ID" in line and "--storage-option key=" in line, line


def test_s3_with_wrong_credentials_exits_2_with_one_line_naming_the_fix(s3_server, s3_root, run_cli):
    with s3_server.enforce_auth():
        code, out, err = run_cli("ls", s3_root.url, *_s3_options(s3_server, "key=wrong", "secret=wrong"))
    assert code == 2 and out == ""
    line = _one_error_line(err)
    assert "refused access" in line and "credentials" in line, line


def test_every_command_documents_its_exit_codes_in_its_help(run_cli):
    from lightning_shardckpt.cli.exit_codes import FOUND_PROBLEM_MEANS

    for command, found in FOUND_PROBLEM_MEANS.items():
        code, out, _ = run_cli(command, "--help")
        assert code == 0
        codes = out[out.index("exit codes:") :]
        assert "0  ran to the end" in codes and "2  could not run" in codes, (command, codes)
        assert (found or "never returned") in codes, (command, codes)
