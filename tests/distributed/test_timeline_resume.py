"""A real Lightning run saved on 2 ranks and resumed on 3: `shardckpt timeline` shows the resume as a
resume from that checkpoint on 2 -> 3 ranks, never as a failed attempt (issue 9, item 11)."""

from __future__ import annotations

from lightning_shardckpt.cli.main import main
from lightning_shardckpt.engine.storage import fsio
from lightning_shardckpt.ops import timeline
from tests.helpers.lightning_run import fit_on_rank
from tests.helpers.spawn import run_ranks


def test_timeline_shows_a_lightning_resume_from_2_to_3_ranks_as_a_resume(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    run_ranks(fit_on_rank, 2, root, "ddp", 3, None, {"every": 3}, timeout_s=240)
    run_ranks(fit_on_rank, 3, root, "ddp", 6, "latest", {"every": 3}, timeout_s=240)

    rows = timeline.timeline(fsio.resolve(root))["checkpoints"]
    assert [row["state"] for row in rows] == ["committed", "resumed", "committed"], rows
    saved, resume, after = rows
    assert resume["step"] == 3 and resume["cause"] is None
    assert resume["resume"]["from"] == saved["name"] and resume["resume"]["from_id"] == saved["id"]
    assert (resume["resume"]["world_size_before"], resume["resume"]["world_size_after"]) == (2, 3)
    assert after["step"] == 6

    assert main(["timeline", root]) == 0
    out = capsys.readouterr().out
    assert f"step 3: resumed from {saved['name']} on 2 -> 3 ranks in " in out
    assert "failed" not in out
