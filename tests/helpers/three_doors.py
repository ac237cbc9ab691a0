"""Inside a rank of `tests.helpers.spawn.run_ranks`: one checkpoint opened by all three front doors, and back.

`one_checkpoint_three_doors` returns plain values for the test to assert on, each against what the Trainer had
when it saved (`trained`: full model + optimizer state, keyed model.<fqn> / optim.<fqn>.<key>):
- the Trainer (ShardedStrategy FSDP2 + ShardedCheckpoint) trains 3 steps and saves; then
- "trainer": a second Trainer resumes it (fit(ckpt_path=ROOT)) and reports its state at train start;
- "fabric": Fabric (FSDP2) loads it (fabric.load), then saves what it loaded (fabric.save, its own layout);
- "checkpointer": a plain FSDP2 loop's Checkpointer loads it into {"model", "optim"} (the mapped layout), what
  it could not restore named in `not_restored`;
- "from_fabric": a second state loads Fabric's checkpoint through the Checkpointer, then saves it (the
  Checkpointer's own layout); "from_checkpointer": Fabric loads that one's model and optimizer (the optimizer is
  under the user's name "optim": found by its param_groups);
- "trainer_from_fabric", "trainer_from_checkpointer": a Trainer opens Fabric's and the Checkpointer's checkpoints
  (fit(ckpt_path=PATH)): model, optimizer and the checkpoint's step (3; the fit goes on to 4), the rest of
  Lightning's loops as a fresh fit sets them up (those doors save none).
Every resume says so in the one console line of training/resume.py ("lines", rank 0).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_shardckpt import Checkpointer, ResumableDistributedSampler, ShardedFabricStrategy
from tests.helpers.fabric_ranks import TrainerShaped, full_state
from tests.helpers.lightning_run import fit_on_rank, lightning_env
from tests.helpers.tiered_doors import ConsoleLines


def unequal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ, or that only one side has."""
    return sorted(key for key in expected.keys() | actual.keys() if key not in actual or key not in expected) + sorted(
        key for key in expected.keys() & actual.keys() if not torch.equal(expected[key], actual[key])
    )


def sharded_plain_model(seed: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A plain loop's FSDP2 model of the Trainer's parameter names (net.0.weight, ...), and its AdamW."""
    model, mesh = TrainerShaped(seed=seed), init_device_mesh("cpu", (world_size,))
    for layer in model.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1.0)


def one_checkpoint_three_doors(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    console = ConsoleLines()
    trainer_root, fabric_root, plain_root = f"{workdir}/trainer", f"{workdir}/fabric", f"{workdir}/plain"
    trained = fit_on_rank(rank, world_size, trainer_root, "fsdp", 3, None, {"every": 3})["final"]
    # (a) the Trainer resumes it (saving on into a root of its own: the others open the step-3 checkpoint)
    resumed = fit_on_rank(rank, world_size, f"{workdir}/resumed", "fsdp", 4, trainer_root, {"every": 3})
    out: dict[str, Any] = {
        "trainer": {
            "unequal": unequal(trained, resumed["at_start"]["full"]),
            "step": resumed["at_start"]["global_step"],
        }
    }

    # (b) Fabric opens it, and saves what it loaded in its own layout
    lightning_env(rank, world_size)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ShardedFabricStrategy(parallelism="fsdp"))
    fabric.launch()
    model = fabric.setup_module(TrainerShaped(seed=99))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1.0))
    fabric.load(trainer_root, {"model": model, "optimizer": optimizer}, strict=False)
    out["fabric"] = {"unequal": unequal(trained, full_state(model.module, optimizer.optimizer))}
    fabric.save(fabric_root, {"model": model, "optimizer": optimizer, "step": 3})
    fabric.strategy.wait()

    # (c) a plain loop's Checkpointer opens it: "net" and "optim" are not the Trainer's names
    sampler = ResumableDistributedSampler(list(range(96)), num_replicas=world_size, rank=rank)
    plain, plain_optimizer = sharded_plain_model(seed=55, world_size=world_size)
    with Checkpointer(plain_root, sampler=sampler) as ckpt:
        step = ckpt.load({"net": plain, "optim": plain_optimizer}, which=trainer_root)
        out["checkpointer"] = {
            "step": step,
            "unequal": unequal(trained, full_state(plain, plain_optimizer)),
            "lr": plain_optimizer.param_groups[0]["lr"],
            "not_restored": list(ckpt.not_restored),
            "position": sampler.global_position,
        }
        # and back: Fabric's checkpoint opens in the Checkpointer, which saves it in its own layout
        again, again_optimizer = sharded_plain_model(seed=56, world_size=world_size)
        state = {"model": again, "optim": again_optimizer}
        out["from_fabric"] = {
            "step": ckpt.load(state, which=fabric_root),
            "unequal": unequal(trained, full_state(again, again_optimizer)),
            "not_restored": list(ckpt.not_restored),
        }
        assert ckpt.save(3, state, blocking=True).result().committed

    # Fabric opens the Checkpointer's checkpoint: the model, and the optimizer it saved under the name "optim"
    fresh = fabric.setup_module(TrainerShaped(seed=5))
    fresh_optimizer = fabric.setup_optimizers(torch.optim.AdamW(fresh.parameters(), lr=1.0))
    fabric.load(plain_root, {"model": fresh, "optimizer": fresh_optimizer})
    out["from_checkpointer"] = {"unequal": unequal(trained, full_state(fresh.module, fresh_optimizer.optimizer))}
    fabric.strategy.teardown()

    # the Trainer opens Fabric's and the Checkpointer's checkpoints: their model, optimizer and step
    for label, source in (("trainer_from_fabric", fabric_root), ("trainer_from_checkpointer", plain_root)):
        warm = fit_on_rank(rank, world_size, f"{workdir}/{label}", "fsdp", 4, source, {"every": 3})
        out[label] = {"unequal": unequal(trained, warm["at_start"]["full"]), "step": warm["at_start"]["global_step"]}
    out["lines"] = console.take()
    return out
