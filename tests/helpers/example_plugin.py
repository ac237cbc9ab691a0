"""The example plug-in of docs/ARCHITECTURE.md ("Write a plug-in"), as printed, and its run through the Trainer and
Fabric doors inside a rank of `tests.helpers.spawn.run_ranks` (tests/unit/test_example_plugin.py: the Checkpointer
in process, these two on one gloo rank)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_shardckpt import SaveConfig, ShardedCheckpoint, ShardedFabricStrategy
from lightning_shardckpt.engine import catalog
from lightning_shardckpt.engine.storage import fsio
from tests.helpers.doc_blocks import REPO, parse
from tests.helpers.fabric_ranks import TrainerShaped
from tests.helpers.lightning_run import TinyData, TinyModule, ddp_trainer, lightning_env

DOCUMENT = "docs/ARCHITECTURE.md"


def example_plugin() -> type:
    text = (REPO / DOCUMENT).read_text()
    section = text[text.index("## Write a plug-in") :]
    (block,) = [block for block in parse(section, DOCUMENT) if block.language == "python"][:1]
    namespace: dict = {}
    exec(compile(block.body, DOCUMENT, "exec"), namespace)  # noqa: S102 - the document's own code, as printed
    return namespace["KeepSteps"]


def committed_steps(root: str) -> list[int]:
    return [entry.step for entry in catalog.list_checkpoints(fsio.resolve(root)) if entry.committed]


def kept_steps(plugin: Any) -> list[int]:
    """The steps of the directory names the plug-in keeps (step-000000002-<id>)."""
    return sorted(int(name.split("-")[1]) for name in plugin.kept)


def example_plugin_through_trainer_and_fabric(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """Each door saves steps 1-4 with keep_last=1 and KeepSteps({2}), then resumes with a fresh KeepSteps and
    saves step 5: the restored state spares step 2 again."""
    KeepSteps = example_plugin()
    lightning_env(rank, world_size)
    out: dict[str, Any] = {}

    root = f"{workdir}/trainer"
    keep, resumed = KeepSteps({2}), KeepSteps(set())
    for plugin, max_steps, ckpt_path in ((keep, 4, None), (resumed, 5, "latest")):
        # synchronous saves: step 2's commit (the listener filling `kept`) comes before step 4's state is taken
        checkpoint = ShardedCheckpoint(
            root,
            every_n_train_steps=1,
            keep_last=1,
            plugins=[plugin],
            save=SaveConfig(async_save=False),
            log_artifact=False,
        )
        ddp_trainer(world_size, max_steps, [checkpoint]).fit(TinyModule(), datamodule=TinyData(), ckpt_path=ckpt_path)
        if plugin is keep:
            steps = committed_steps(root)
    out["trainer"] = {
        "steps": steps,
        "commits": keep.commits,
        "resumed_kept": kept_steps(resumed),
        "steps_after_resume": committed_steps(root),
    }

    root = f"{workdir}/fabric"
    keep = KeepSteps({2})
    strategy = ShardedFabricStrategy(parallelism="ddp", root=root, keep_last=1, plugins=[keep])
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(TrainerShaped(seed=1))
    for step in (1, 2, 3, 4):
        fabric.save(root, {"model": model, "step": step})
        strategy.wait()
    strategy.teardown()
    steps = committed_steps(root)
    resumed = KeepSteps(set())
    strategy = ShardedFabricStrategy(parallelism="ddp", root=root, keep_last=1, plugins=[resumed])
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    state = {"model": fabric.setup_module(TrainerShaped(seed=2)), "step": 0}
    fabric.load(root, state)
    fabric.save(root, {**state, "step": 5})
    strategy.wait()
    strategy.teardown()
    out["fabric"] = {
        "steps": steps,
        "commits": keep.commits,
        "resumed_kept": kept_steps(resumed),
        "steps_after_resume": committed_steps(root),
        "loaded_step": state["step"],
    }
    torch.distributed.barrier()
    return out
