"""Issue 39 with tiers: the tier choice honours the resume's signature policy. A signed plain-loop run on 2 real gloo
ranks saves steps 1-3 on a fast tier (local disk), every commit copied to a durable tier (local disk, re-signed
there as a signed run's copies are); then copies of that pair of roots are tampered with and resumed with
`require_signature`:

- step 3 forged on the fast tier (values replaced, every checksum and digest recomputed) and unsigned on the durable
  tier: `latest` passes over it on both tiers to step 2, counts it (`checkpoint/signature_skipped` = 1, the resume
  event names it) and the log names both refused copies;
- step 3 forged on the fast tier only: its durable copy is validly signed, so step 3 is resumed from there, and
  nothing was passed over (0);
- a reader whose key signed none of them: the error says the signature policy refused every candidate.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import pytest

from lightning_shardckpt import Checkpointer
from lightning_shardckpt.engine import catalog, metrics
from lightning_shardckpt.engine.format import signing
from lightning_shardckpt.engine.format.names import join
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.forgery import forge_tensor_values
from tests.helpers.log_capture import MessageLines
from tests.helpers.spawn import run_ranks, values
from tests.helpers.tiered_doors import TrainerShaped, step_held, tiers, weights_at
from tests.unit.test_signing import make_key

pytestmark = pytest.mark.timeout(420)

SCENARIOS = ("forged fast, unsigned durable", "forged fast only", "no accepted key")


def write_signed_tiered(rank: int, world_size: int, workdir: str, key_path: str) -> None:
    model = TrainerShaped(seed=1)
    with Checkpointer(tiers=tiers(workdir), save={"sign": {"key_path": key_path}}) as ckpt:
        for step in (1, 2, 3):
            model.load_state_dict(weights_at(step))
            assert ckpt.save(step, {"model": model}, blocking=True).result().committed


def resume_each(rank: int, world_size: int, workdirs: dict[str, str], keys: dict[str, str]) -> dict[str, Any]:
    """Every scenario's copy of the roots, resumed `latest` with require_signature and that scenario's public key."""
    out = {}
    lines = MessageLines()
    logging.getLogger("lightning_shardckpt").addHandler(lines)
    logging.getLogger("lightning_shardckpt").setLevel(logging.INFO)
    for scenario, workdir in workdirs.items():
        logged: list[dict[str, float]] = []
        model = TrainerShaped(seed=9)
        lines.lines.clear()
        with Checkpointer(
            tiers=tiers(workdir),
            require_signature=True,
            public_keys=[keys[scenario]],
            log_metrics=lambda values, step, logged=logged: logged.append(dict(values)),
        ) as ckpt:
            try:
                ckpt.load({"model": model})
            except Exception as err:  # noqa: BLE001 - the error is the scenario's answer
                out[scenario] = {"error": f"{type(err).__name__}: {err}"}
                continue
            loaded = ckpt.last_load
            out[scenario] = {
                "step": step_held(model),
                "path": loaded.path,
                "skipped": list(loaded.signature_skipped or ()),
                "metrics": logged,
                "lines": list(lines.lines),
            }
    return out


def unsign(directory: str) -> None:
    """What a writer without the key leaves: no manifest.sig (removed, as someone with write access can)."""
    os.remove(join(directory, signing.SIGNATURE))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    base = tmp_path_factory.mktemp("signed-tiers")
    private, public, _ = make_key(base, "writer")
    _, stranger, _ = make_key(base, "stranger")
    written = str(base / "written")
    run_ranks(write_signed_tiered, 2, written, private, timeout_s=180)
    workdirs, names = {}, {}
    for index, scenario in enumerate(SCENARIOS):
        workdir = str(base / f"scenario-{index}")
        shutil.copytree(written, workdir)
        workdirs[scenario] = workdir
        fast, durable = fsio.resolve(f"{workdir}/fast"), fsio.resolve(f"{workdir}/durable")
        (newest,) = [e for e in catalog.list_checkpoints(fast) if e.step == 3]
        assert [e.step for e in catalog.list_checkpoints(durable) if e.committed] == [1, 2, 3]
        names[scenario] = newest.name
        if scenario != "no accepted key":
            forge_tensor_values(fast, newest.path, "model.net.0.weight", 7.0)
        if scenario == "forged fast, unsigned durable":
            unsign(join(durable.path, newest.name))
    keys = {scenario: public for scenario in SCENARIOS} | {"no accepted key": stranger}
    return values(run_ranks(resume_each, 2, workdirs, keys, timeout_s=360)), workdirs, names


def resumed_alike(resumed, scenario: str) -> tuple[dict[str, Any], str, str]:
    """Rank 0's resume of `scenario` once every rank resumed without error and alike (step, copy, passed over);
    with the scenario's newest checkpoint name and workdir."""
    ranks, workdirs, names = resumed
    for rank in ranks:
        assert "error" not in rank[scenario], rank[scenario]
    alike = {(r[scenario]["step"], r[scenario]["path"], tuple(r[scenario]["skipped"])) for r in ranks}
    assert len(alike) == 1, alike
    return ranks[0][scenario], names[scenario], workdirs[scenario]


def test_a_forged_fast_copy_and_an_unsigned_durable_copy_are_passed_over_and_counted(resumed):
    result, newest, workdir = resumed_alike(resumed, "forged fast, unsigned durable")
    assert result["step"] == 2 and result["path"].startswith(f"{workdir}/fast/"), result
    assert result["skipped"] == [newest]
    assert result["metrics"] == [{"checkpoint/signature_skipped": 1.0}]
    # the log names both refused copies, and the resume line what it passed over
    lines = result["lines"]
    assert any(f"skipping fast:{newest} for `latest`" in line for line in lines), lines
    assert any(f"skipping durable:{newest} for `latest`" in line and "unsigned" in line for line in lines), lines
    assert any("resuming from the fast tier" in line and f"refused them): {newest}" in line for line in lines), lines
    # the resume event (the fast tier's root: the run's own) names it, as without tiers
    resumes = [e for e in metrics.read_events(fsio.resolve(f"{workdir}/fast")) if e.get("event") == "resume"]
    assert [(e["signature_skipped"], e["signature_skipped_names"], e["step"]) for e in resumes] == [(1, [newest], 2)]


def test_a_forged_fast_copy_resumes_the_validly_signed_durable_copy_of_the_same_checkpoint(resumed):
    result, newest, workdir = resumed_alike(resumed, "forged fast only")
    assert result["step"] == 3 and result["path"] == f"{workdir}/durable/{newest}", result
    assert result["skipped"] == []  # the checkpoint was resumed: only one copy of it was refused
    assert result["metrics"] == [{"checkpoint/signature_skipped": 0.0}]
    lines = result["lines"]
    assert any(f"skipping fast:{newest} for `latest`" in line for line in lines), lines
    assert not any("did not load; falling back" in line for line in lines), (
        lines
    )  # chosen up front, not after a failed load


def test_no_accepted_signature_on_either_tier_says_the_signature_policy_refused_every_candidate(resumed):
    ranks, _, names = resumed
    scenario = "no accepted key"
    for rank in ranks:
        error = rank[scenario].get("error", "")
        assert error.startswith("SignatureRefused: the signature policy refused every candidate for 'latest'"), rank
        assert f"fast:{names[scenario]}" in error and f"durable:{names[scenario]}" in error
        assert "not readable by every rank" not in error
