"""A key's acceptance ends (issue 47 item 13): a `public_keys` entry with a validity window (`not_after_step`,
`not_after`, judged on the signed manifest's step and created_at) and `revoked_keys`, enforced by the one
SignaturePolicy every reader builds: load, list_checkpoints, resolve_checkpoint, `shardckpt verify` / `ls`, and the
tier replicator. Real Ed25519 keys (the `cryptography` package), real checkpoints on local disk."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from lightning_shardckpt import Checkpointer, LoadConfig, list_checkpoints, resolve_checkpoint
from lightning_shardckpt.engine.config import SignConfig
from lightning_shardckpt.engine.format import signing
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.errors import ConfigError
from lightning_shardckpt.ops.verify import SIGNATURE_PROBLEM, verify_checkpoint
from tests.unit.test_signing import load, make_key, save

WINDOW_REFUSED = r"outside its validity window \(step 3 is after not_after_step=2"


def kid_of(key: ed25519.Ed25519PrivateKey) -> str:
    return signing.key_id(key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


@pytest.fixture
def retired_run(tmp_path):
    """Steps 1-3 signed by key `old`, which the operator retired after step 2."""
    private, public, key = make_key(tmp_path, "old")
    root = str(tmp_path / "root")
    names = {step: os.path.basename(save(root, step, SignConfig(key_path=private))) for step in (1, 2, 3)}
    return root, public, key, names


def test_a_key_past_its_step_window_is_refused_by_every_reader_and_latest_falls_back_within_it(retired_run, run_cli):
    root, public, _, names = retired_run
    window = {"path": public, "not_after_step": 2}
    options = {"require_signature": True, "public_keys": [window]}
    result, _ = load(root, **options)
    assert result.step == 2 and result.signature_skipped == (names[3],)  # passed over as an unsigned one is
    with pytest.raises(signing.SignatureRefused, match=WINDOW_REFUSED):
        load(root, 3, **options)
    assert resolve_checkpoint(root, public_keys=[window]).step == 2
    with pytest.raises(signing.SignatureRefused, match=WINDOW_REFUSED):
        resolve_checkpoint(root, 3, public_keys=[window])
    listing = list_checkpoints(root, public_keys=[window])
    assert listing.latest.step == 2
    assert [(info.step, info.signature) for info in listing.checkpoints] == [
        (1, "signed"),
        (2, "signed"),
        (3, "refused"),
    ]
    report = verify_checkpoint(root, 3, public_keys=[window])
    assert [p["kind"] for p in report.problems] == [SIGNATURE_PROBLEM]
    assert verify_checkpoint(root, 2, public_keys=[window]).ok
    code, _, _ = run_cli("verify", os.path.join(root, names[3]), "--public-key", f"{public},not_after_step=2")
    assert code != 0
    code, out, _ = run_cli("verify", os.path.join(root, names[2]), "--public-key", f"{public},not_after_step=2")
    assert code == 0, out
    code, out, _ = run_cli("ls", root, "--json", "--public-key", f"{public},not_after_step=2")
    assert code == 0 and json.loads(out)["latest"] == names[2]


def test_the_refusal_names_the_key_id_the_window_and_the_fix(retired_run):
    root, public, key, _ = retired_run
    with pytest.raises(signing.SignatureRefused) as refused:
        load(root, 3, require_signature=True, public_keys=[{"path": public, "not_after_step": 2}])
    message = str(refused.value)
    assert kid_of(key)[:16] in message and repr(public) in message and "not_after_step=2" in message
    assert "resume a checkpoint within its window" in message and "widen that public_keys entry" in message


def test_a_time_window_judges_the_signed_created_at(retired_run):
    root, public, _, names = retired_run
    manifest = json.loads(Path(root, names[2], "manifest.json").read_bytes())
    created = datetime.fromisoformat(manifest["created_at"])
    at_step_2 = {"path": public, "not_after": created.isoformat()}  # inclusive: step 2 itself still in
    assert load(root, require_signature=True, public_keys=[at_step_2])[0].step == 2
    before = {"path": public, "not_after": (created - timedelta(milliseconds=1)).isoformat()}
    with pytest.raises(signing.SignatureRefused, match=r"created_at .* is after not_after="):
        load(root, 2, require_signature=True, public_keys=[before])
    assert load(root, require_signature=True, public_keys=[before])[0].step == 1


def test_a_revoked_key_is_refused_everywhere_even_where_public_keys_lists_it(tmp_path, run_cli):
    old_private, old_public, old_key = make_key(tmp_path, "leaked")
    new_private, new_public, _ = make_key(tmp_path, "new")
    root = str(tmp_path / "root")
    first = os.path.basename(save(root, 1, SignConfig(key_path=new_private)))
    leaked = os.path.basename(save(root, 2, SignConfig(key_path=old_private)))
    kid = kid_of(old_key)
    keys = [old_public, new_public]
    for revoked in ([kid], [kid[:16]], [old_public]):  # the id, the prefix a refusal prints, the key's PEM file
        options = {"require_signature": True, "public_keys": keys, "revoked_keys": revoked}
        result, _ = load(root, **options)
        assert result.step == 1 and result.signature_skipped == (leaked,)
        with pytest.raises(signing.SignatureRefused, match=f"signed by key {kid[:16]}, which is revoked"):
            load(root, 2, **options)
        assert resolve_checkpoint(root, public_keys=keys, revoked_keys=revoked).name == first
        with pytest.raises(signing.SignatureRefused, match="which is revoked"):
            resolve_checkpoint(root, 2, public_keys=keys, revoked_keys=revoked)
        listing = list_checkpoints(root, public_keys=keys, revoked_keys=revoked)
        assert listing.latest.step == 1 and [i.signature for i in listing.checkpoints] == ["signed", "refused"]
        assert not verify_checkpoint(root, 2, public_keys=keys, revoked_keys=revoked).ok
    flags = ["--public-key", old_public, "--public-key", new_public, "--revoked-key", kid[:16]]
    assert run_cli("verify", os.path.join(root, leaked), *flags)[0] != 0
    assert run_cli("verify", os.path.join(root, first), *flags)[0] == 0
    code, out, _ = run_cli("ls", root, "--json", *flags)
    assert code == 0 and json.loads(out)["latest"] == first


def test_the_replicator_copies_no_checkpoint_outside_a_window_or_signed_by_a_revoked_key(tmp_path):
    from lightning_shardckpt.engine.tiers.config import TierConfig, TiersConfig
    from lightning_shardckpt.engine.tiers.replicate import Replicator

    old_private, old_public, old_key = make_key(tmp_path, "old")
    own_private, _, _ = make_key(tmp_path, "own")
    fast = str(tmp_path / "fast")
    names = [os.path.basename(save(fast, step, SignConfig(key_path=old_private))) for step in (1, 2)]
    config = TiersConfig(fast=TierConfig(dirpath=fast), durable=TierConfig(dirpath=str(tmp_path / "durable")))

    def copied(public_keys, revoked_keys=()) -> list[bool]:
        """Each fast checkpoint submitted alone to a fresh replicator (it copies only the newest it is owed)."""
        answers = []
        for name in names:
            target = tmp_path / f"durable-{len(list(tmp_path.glob('durable-*')))}"
            replicator = Replicator(
                TiersConfig(fast=config.fast, durable=TierConfig(dirpath=str(target))),
                fsio.resolve(fast),
                fsio.resolve(str(target)),
                group=None,
                sign=SignConfig(key_path=own_private),
                public_keys=public_keys,
                revoked_keys=revoked_keys,
            )
            replicator.submit(name)
            replicator.close(30)
            answers.append((target / name / "manifest.json").exists())
        return answers

    assert copied((old_public,)) == [True, True]
    assert copied((signing.AcceptedKey(old_public, not_after_step=1),)) == [True, False]
    assert copied((old_public,), (kid_of(old_key),)) == [False, False]


def test_without_windows_or_revocations_every_listed_key_signs_every_step(retired_run):
    root, public, _, _ = retired_run
    for keys in ([public], [{"path": public}], public):
        config = LoadConfig(require_signature=True, public_keys=keys)
        assert config.revoked_keys == ()
        policy = signing.policy_of(config.require_signature, config.public_keys, config.revoked_keys)
        assert policy.windows == {} and policy.revoked == frozenset()
        assert load(root, require_signature=True, public_keys=keys)[0].step == 3
        assert [i.signature for i in list_checkpoints(root, public_keys=keys).checkpoints] == ["signed"] * 3


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"revoked_keys": ["not-a-key-id"]}, r"revoked_keys entry 'not-a-key-id' is neither a key id"),
        ({"revoked_keys": "abc"}, r"revoked_keys entry 'abc' is neither a key id \(16 to 64 hex"),
        ({"public_keys": [{"path": "{pub}", "not_after_step": "ten"}]}, r"not_after_step='ten' is not a step"),
        ({"public_keys": [{"path": "{pub}", "not_after_step": True}]}, r"not_after_step=True is not a step"),
        ({"public_keys": [{"path": "{pub}", "not_after": "yesterday"}]}, r"not_after='yesterday' is not a time"),
        ({"public_keys": [{"path": "{pub}", "not_before": 3}]}, r"unknown option\(s\) \['not_before'\]"),
        ({"public_keys": [{"not_after_step": 3}]}, r"has no `path`"),
    ],
)
def test_window_and_revocation_options_are_checked_when_the_options_are_built(tmp_path, options, problem):
    _, public, _ = make_key(tmp_path, "k")
    options = json.loads(json.dumps(options).replace("{pub}", public.replace("\\", "\\\\")))
    with pytest.raises(ConfigError, match=problem):
        LoadConfig(require_signature=True, **({"public_keys": [public]} | options))
    with pytest.raises(ConfigError, match=problem):
        Checkpointer(str(tmp_path / "root"), require_signature=True, **({"public_keys": [public]} | options))
    assert not (tmp_path / "root").exists()


def test_the_cli_refuses_a_window_or_revoked_key_it_cannot_judge_before_reading(tmp_path, run_cli):
    _, public, _ = make_key(tmp_path, "k")
    root = str(tmp_path / "root")
    save(root, 1)
    code, _, err = run_cli("verify", root, "--public-key", f"{public},not_after=never")
    assert code == 2 and "not_after='never' is not a time" in err
    code, _, err = run_cli("ls", root, "--public-key", public, "--revoked-key", "xyz")
    assert code == 2 and "'xyz' is neither a key id" in err


def test_format_md_window_vectors_are_this_codes_verdicts(tmp_path):
    """docs/FORMAT.md §12.1's vectors: the §12 key signs a manifest at step 7; each window's verdict."""
    text = Path(__file__).parents[2].joinpath("docs", "FORMAT.md").read_text()
    blocks = dict(re.findall(r"<!-- vector: (signature [a-z ]+) -->\n```[a-z]*\n(.*?)\n```", text, re.S))
    key = ed25519.Ed25519PrivateKey.from_private_bytes(bytes.fromhex(blocks["signature key seed"].strip()))
    manifest_bytes = blocks["signature window manifest"].encode() + b"\n"
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "manifest.json").write_bytes(manifest_bytes)
    signer = signing.signer_from_private_key(key, "vector")
    (directory / signing.SIGNATURE).write_bytes(signing.signature_bytes(manifest_bytes, signer))
    public = tmp_path / "vector.pub"
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    verdicts = json.loads(blocks["signature window verdicts"])
    assert len(verdicts) >= 4
    for case in verdicts:
        entry = {"path": str(public), **case["window"]}
        policy = signing.accepted_policy([entry], case.get("revoked_keys", ()))
        try:
            policy.check_manifest(fsio.resolve(str(directory)).fs, str(directory), json.loads(manifest_bytes))
            verdict = "accepted"
        except signing.SignatureRefused:
            verdict = "refused"
        assert verdict == case["verdict"], case


def test_a_yaml_window_entry_and_revocation_reach_the_callbacks_policy(retired_run, tmp_path):
    """conf/checkpoint/default.yaml's spelling, as Hydra hands it over (DictConfig entries, ListConfig lists)."""
    from omegaconf import OmegaConf

    from lightning_shardckpt import ShardedCheckpoint

    root, public, key, _ = retired_run
    yaml = OmegaConf.create(
        f"public_keys: [{{path: {public}, not_after_step: 2, not_after: '2100-01-01T00:00:00Z'}}]\n"
        f"revoked_keys: ['{'0' * 16}']\n"
    )
    callback = ShardedCheckpoint(
        str(tmp_path / "run"), require_signature=True, public_keys=yaml.public_keys, revoked_keys=yaml.revoked_keys
    )
    config = callback.load_options
    assert config.public_keys == (signing.AcceptedKey(public, 2, datetime.fromisoformat("2100-01-01T00:00:00+00:00")),)
    assert config.revoked_keys == ("0" * 16,)
    policy = signing.policy_of(config.require_signature, config.public_keys, config.revoked_keys)
    assert set(policy.windows) == {kid_of(key)} and policy.revoked == {"0" * 16}
    assert load(root, require_signature=True, public_keys=config.public_keys)[0].step == 2


def test_a_drill_refuses_a_checkpoint_outside_its_keys_window_or_revoked_before_it_forks(retired_run):
    from lightning_shardckpt.policies.drills import worker
    from lightning_shardckpt.policies.drills.runner import DrillOptions, _rank_argv, run_drill

    root, public, key, names = retired_run
    window = {"path": public, "not_after_step": 2}
    for options, why in (
        (DrillOptions(public_keys=[window]), "outside its validity window"),
        (DrillOptions(public_keys=[public], revoked_keys=[kid_of(key)]), "which is revoked"),
    ):
        record = run_drill(os.path.join(root, names[3]), options)
        assert record["verdict"] == "failed" and record.get("signature_refused"), record
        assert why in record["cause"]
    # an accepted checkpoint's drill ranks get the same window and revocations on their command line
    options = DrillOptions(public_keys=[window], revoked_keys=[kid_of(key)[:16]])
    args = worker._parse(_rank_argv(os.path.join(root, names[2]), 0, 1, "out.json", 0.0, options))
    assert [signing.public_key_argument(spec) for spec in args.public_key] == [signing.AcceptedKey(public, 2)]
    assert args.revoked_key == [kid_of(key)[:16]]
