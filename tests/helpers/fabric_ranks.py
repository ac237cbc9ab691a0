"""Inside a rank of `tests.helpers.spawn.run_ranks`: a Trainer run, then Fabric loops on the same process group.

`trainer_then_fabric` returns plain values for the test to assert on:
- "trainer": a Trainer (ShardedStrategy + ShardedCheckpoint, FSDP2) trains 3 steps and saves; Fabric (FSDP2) loads
  that checkpoint into a model of the same parameter names and an AdamW: weights, optimizer state, the step and
  the sampler position against what the Trainer had at the end;
- "fabric": Fabric (DDP) round trip: 'latest' of an empty root starts fresh, then model, optimizer, LR scheduler,
  plain values and the loader's position are saved (fabric.save returning before the commit), scrambled and
  loaded back; what cannot be saved or loaded
  fails with its message.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader, TensorDataset

from lightning_shardckpt import ShardedFabricStrategy, UntrustedCheckpoint
from tests.helpers import training_state as ts
from tests.helpers.faults import Stall
from tests.helpers.lightning_run import TinyData, fit_on_rank, lightning_env
from tests.helpers.log_capture import warnings_of


class TrainerShaped(torch.nn.Module):
    """The parameter names of tests/helpers/lightning_run.py's TinyModule (`net.0.weight`, ...)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = ts.build_model(seed=seed)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)


class NotAllowed:
    """A class no allow-list names: a resume could not unpickle it."""


def full_state(module: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Model and optimizer state assembled in full (a collective), flat: model.<fqn>, optim.<fqn>.<key>."""
    model_sd, optim_sd = get_state_dict(
        module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    flat = {f"model.{key}": value.clone() for key, value in model_sd.items()}
    for name, state in optim_sd.get("state", {}).items():
        for key, value in state.items():
            flat[f"optim.{name}.{key}"] = torch.as_tensor(value).clone()
    return flat


def full_model(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state assembled in full (a collective), keyed model.<fqn>."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {f"model.{key}": value.clone() for key, value in full.items()}


def loader_like_trainer_data() -> DataLoader:
    """TinyData's training set, shuffled by the injected sampler as the Trainer's was not: only the length counts."""
    return TinyData().train_dataloader()


def trainer_then_fabric(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    trainer_root = f"{workdir}/trainer"
    trained = fit_on_rank(rank, world_size, trainer_root, "fsdp", 3, None, {"every": 3})
    lightning_env(rank, world_size)
    return {"trainer": _load_trainer_checkpoint(trainer_root, trained), "fabric": _fabric_round_trip(workdir)}


def _load_trainer_checkpoint(root: str, trained: dict[str, Any]) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ShardedFabricStrategy(parallelism="fsdp"))
    fabric.launch()
    model = fabric.setup_module(TrainerShaped(seed=99))  # other initial weights than the Trainer's
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1.0))
    loader = fabric.setup_dataloaders(loader_like_trainer_data())
    state = {"model": model, "optimizer": optimizer, "global_step": 0, "train_dataloader": loader}
    remainder = fabric.load(root, state)
    loaded = full_state(model.module, optimizer.optimizer)
    expected = trained["final"]

    # a plain torch file (LitGPT's lit_model.pth) still loads through Fabric's own load_raw
    raw_file = f"{root}-raw.pth"
    if fabric.global_rank == 0:
        torch.save(
            {key[len("model.") :]: value for key, value in expected.items() if key.startswith("model.")}, raw_file
        )
    fabric.barrier()
    raw_model = fabric.setup_module(TrainerShaped(seed=5))
    fabric.load_raw(raw_file, raw_model)
    raw = full_model(raw_model.module)
    fabric.strategy.teardown()
    return {
        "raw_unequal": sorted(key for key in raw if not torch.equal(raw[key], expected[key])),
        "keys_equal": sorted(loaded) == sorted(expected),
        "unequal": sorted(key for key in expected if key in loaded and not torch.equal(loaded[key], expected[key])),
        "global_step": state["global_step"],
        "lr": optimizer.param_groups[0]["lr"],
        "position": loader.sampler.global_position,
        "remainder_keys": sorted(remainder),
        "loaded_step": fabric.strategy.last_load.step,
    }


def _fabric_round_trip(workdir: str) -> dict[str, Any]:
    root = f"{workdir}/fabric"
    # the commit waits 1 s: fabric.save must have returned long before it
    strategy = ShardedFabricStrategy(parallelism="ddp", root=root, fault_hook=Stall("before_manifest", 1.0))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(TrainerShaped(seed=1))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5)
    inputs = torch.randn(24, 13, generator=torch.Generator().manual_seed(5))
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(inputs), batch_size=2, shuffle=True))
    state = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "loader": loader,
        "step": 0,
        "notes": {"tokens": [1, 2, 3]},
    }
    out: dict[str, Any] = {"fresh": fabric.load("latest", state), "step_after_fresh": state["step"]}
    for (batch,) in loader:
        fabric.backward(model(batch).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        loader.sampler.mark_consumed(1, 2)
        state["step"] += 1
        if state["step"] == 2:
            break
    fabric.save(root, state)  # returns after staging
    out["returned_before_commit"] = not strategy.last_save.done()
    saved = full_state(model.module, optimizer.optimizer)
    out["position_saved"] = loader.sampler.global_position
    out["last_lr_saved"] = scheduler.get_last_lr()
    strategy.wait()
    out["committed"] = strategy.last_save.result().committed

    with warnings_of("lightning_shardckpt.training.loadable") as warned:  # saved, with a warning naming the fixes
        for _ in range(2):  # told once, not at every save
            fabric.save(f"{workdir}/unsafe", {**state, "bad": NotAllowed()})
            strategy.wait()
    out["unsafe_warnings"] = warned
    try:
        fabric.load(f"{workdir}/unsafe", {"model": model}, strict=False)
    except UntrustedCheckpoint as err:
        out["unsafe_error"] = str(err)

    with torch.no_grad():  # scramble everything the load must restore
        for parameter in model.parameters():
            parameter.add_(1.0)
    for _ in range(3):
        scheduler.step()
    state["step"], state["notes"] = -1, None
    loader.sampler.mark_consumed(3, 2)

    out["remainder"] = fabric.load("latest", state)
    loaded = full_state(model.module, optimizer.optimizer)
    out["unequal"] = sorted(key for key in saved if not torch.equal(saved[key], loaded[key]))
    out["step"], out["notes"] = state["step"], state["notes"]
    out["position"] = loader.sampler.global_position
    out["last_lr"] = scheduler.get_last_lr()
    try:
        fabric.load(root, {"model": model, "missing": 0})
    except KeyError as err:
        out["missing_error"] = str(err)
    out["partial"] = fabric.load(root, {"model": model, "missing": 0}, strict=False)
    strategy.teardown()
    return out
