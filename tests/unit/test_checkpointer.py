"""The plain PyTorch front door (Checkpointer) in one process, world size 1 (no process group): schedule,
retention, resume of every piece of state, run ids in either order, close, metrics, and the state's checks."""

from __future__ import annotations

import enum
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_shardckpt import (
    Checkpointer,
    CheckpointNotFound,
    CheckpointSaver,
    ConfigError,
    IncompatibleCheckpoint,
    LoadConfig,
    ResumableDistributedSampler,
    SaveConfig,
    UntrustedCheckpoint,
)
from lightning_shardckpt.engine.catalog import find, list_checkpoints
from lightning_shardckpt.engine.storage.fsio import resolve
from lightning_shardckpt.policies.plan import Placement
from lightning_shardckpt.policies.plugin import PluginList
from lightning_shardckpt.training.checkpoint_setup import checkpoint_plan

BATCH = 4


class Run:
    """A tiny model with dropout (the RNG matters), AdamW, a scheduler, a resumable sampler and a plain counter."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.data = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6) / 100
        self.sampler = ResumableDistributedSampler(self.data, num_replicas=1, rank=0, seed=3)
        self.state = {"model": self.model, "optim": self.optimizer, "sched": self.scheduler, "progress": {"seen": 0}}
        self._batches = None

    def train_step(self) -> None:
        if self._batches is None:
            # its own generator: creating an iterator then draws no seed from the global RNG, so an iterator created
            # at the resume leaves the dropout masks as they would have been
            loader = torch.utils.data.DataLoader(
                self.data, batch_size=BATCH, sampler=self.sampler, generator=torch.Generator()
            )
            self._batches = iter(loader)
        batch = next(self._batches)
        self.model(batch).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.sampler.mark_consumed(1, BATCH)
        self.state["progress"]["seen"] += len(batch)


def committed(root: str) -> list:
    return [entry for entry in list_checkpoints(resolve(root)) if entry.committed]


def test_maybe_save_follows_the_schedule_saves_the_last_step_and_keep_last_retains_the_newest(tmp_path):
    root, run = str(tmp_path / "run"), Run()
    with Checkpointer(root, every_n_steps=2, max_steps=5, keep_last=2) as ckpt:
        saved = []
        for step in range(1, 6):
            run.train_step()
            if ckpt.maybe_save(step, run.state) is not None:
                saved.append(step)
    assert saved == [2, 4, 5]  # every 2 steps, and max_steps
    assert [entry.step for entry in committed(root)] == [4, 5]  # retention ran after each commit


def test_a_load_restores_model_optimizer_scheduler_sampler_rng_and_plain_values_bit_exact(tmp_path):
    root = str(tmp_path / "run")
    uninterrupted = Run()
    for _ in range(6):
        uninterrupted.train_step()

    first = Run()
    with Checkpointer(root, every_n_steps=3, sampler=first.sampler) as ckpt:
        for step in range(1, 5):  # step 4 is trained but never saved: lost, as in a crash
            first.train_step()
            ckpt.maybe_save(step, first.state)

    resumed = Run(seed=99)  # other weights and RNG: everything must come from the checkpoint
    with Checkpointer(root, every_n_steps=3, sampler=resumed.sampler) as ckpt:
        assert ckpt.load(resumed.state) == 3
        assert resumed.sampler.global_position == 3 * BATCH
        assert resumed.state["progress"] == {"seen": 3 * BATCH}
        assert resumed.scheduler.last_epoch == 3
        for step in range(4, 7):
            resumed.train_step()
            ckpt.maybe_save(step, resumed.state)
    for (name, expected), actual in zip(uninterrupted.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(actual, expected), name  # dropout masks, AdamW moments, data order: all as uninterrupted


def test_load_on_an_empty_root_returns_none_and_resume_required_refuses(tmp_path):
    run = Run()
    with Checkpointer(str(tmp_path / "empty")) as ckpt:
        assert ckpt.load(run.state) is None
    with Checkpointer(str(tmp_path / "empty2"), resume_required=True) as ckpt:
        with pytest.raises(CheckpointNotFound, match="resume_required"):
            ckpt.load(run.state)


def test_constructed_before_the_load_a_resume_continues_the_loaded_run_and_its_root(tmp_path):
    root, run = str(tmp_path / "run"), Run()
    with Checkpointer(root, every_n_steps=1) as ckpt:
        run.train_step()
        ckpt.maybe_save(1, run.state)
        first_id = ckpt.run_id
    # the README's failing order was: create the saver, then load; here construction claims nothing
    with Checkpointer(root, every_n_steps=1) as ckpt:
        step = ckpt.load(run.state)
        run.train_step()
        ckpt.maybe_save(step + 1, run.state)
        assert ckpt.run_id == first_id
    assert [(entry.step, entry.run_id) for entry in committed(root)] == [(1, first_id), (2, first_id)]


def test_saved_before_a_load_a_rollback_within_the_run_keeps_its_id(tmp_path):
    root, run = str(tmp_path / "run"), Run()
    with Checkpointer(root) as ckpt:
        ckpt.save(2, run.state)
        ckpt.save(4, run.state)
        run_id = ckpt.run_id
        assert ckpt.load(run.state, which=2) == 2  # waits for the saves in flight, then loads step 2
        ckpt.save(3, run.state, blocking=True)
        assert ckpt.run_id == run_id
    assert sorted((entry.step, entry.run_id) for entry in committed(root)) == [(2, run_id), (3, run_id), (4, run_id)]
    assert find(resolve(root), "latest").step == 3  # the newest commit: the rolled-back branch


def test_a_new_run_into_a_used_root_is_refused_at_its_first_save_with_the_checkpointers_advice(tmp_path):
    root, run = str(tmp_path / "run"), Run()
    with Checkpointer(root) as ckpt:
        ckpt.save(1, run.state)
    with Checkpointer(root) as ckpt:
        with pytest.raises(ConfigError, match="belongs to another run") as refused:
            ckpt.maybe_save(1, run.state)
    message = str(refused.value)
    assert "checkpointer.load(state) before the first save" in message and "allow_shared_root" in message
    assert "ckpt_path" not in message and "Hydra" not in message and "resume=latest" not in message
    assert [entry.step for entry in committed(root)] == [1]


def test_close_waits_for_the_last_commit_and_a_closed_checkpointer_refuses_to_save(tmp_path):
    root, run = str(tmp_path / "run"), Run()
    ckpt = Checkpointer(root)
    pending = ckpt.save(1, run.state)  # asynchronous
    ckpt.close()
    assert pending.done() and pending.result().committed
    ckpt.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.maybe_save(2, run.state)


def test_an_exception_in_the_loop_lets_the_save_in_flight_commit_and_saves_nothing_more(tmp_path):
    root, run = str(tmp_path / "run"), Run()
    with pytest.raises(ValueError, match="boom"):
        with Checkpointer(root, every_n_steps=1, max_steps=10) as ckpt:
            ckpt.maybe_save(1, run.state)
            raise ValueError("boom")
    assert [entry.step for entry in committed(root)] == [1]


def test_log_metrics_receives_each_finished_save_at_its_step(tmp_path):
    logged: list[tuple[int, dict]] = []
    run = Run()
    with Checkpointer(
        str(tmp_path / "run"), every_n_steps=2, log_metrics=lambda values, step: logged.append((step, values))
    ) as ckpt:
        for step in range(1, 5):
            run.train_step()
            ckpt.maybe_save(step, run.state)
    records = [values for _, values in logged if "checkpoint/total_s" in values]
    assert len(records) == 2 and all(values["checkpoint/committed"] >= 1 for values in records)
    assert all(step in (3, 4) for step, _ in logged)  # drained at the next step, or at close (step 4)


def test_a_state_the_checkpointer_cannot_save_is_refused_naming_the_fix(tmp_path):
    run = Run()
    with Checkpointer(str(tmp_path / "run")) as ckpt:
        with pytest.raises(ConfigError, match="exactly one module"):
            ckpt.save(1, {"a": run.model, "b": torch.nn.Linear(2, 2), "optim": run.optimizer})
        with pytest.raises(ConfigError, match="Checkpointer's own entry"):
            ckpt.save(1, {"model": run.model, "checkpointer": 1})
        with pytest.raises(ConfigError, match="non-empty dict"):
            ckpt.load([run.model])


def test_the_owner_refusal_advises_in_the_words_of_the_api_that_created_the_saver(tmp_path):
    root = str(tmp_path / "run")
    CheckpointSaver(root, SaveConfig(run_id="run-a")).close()
    with pytest.raises(ConfigError) as engine:
        CheckpointSaver(root, SaveConfig(run_id="run-b"))
    assert "SaveConfig(run_id=result.manifest['run_id'])" in str(engine.value)
    assert "ckpt_path" not in str(engine.value) and "resume=latest" not in str(engine.value)
    with pytest.raises(ConfigError) as lightning:
        CheckpointSaver(root, SaveConfig(run_id="run-b", front_door="lightning"))
    assert "ckpt_path='latest'" in str(lightning.value) and "resume=latest" in str(lightning.value)
    with pytest.raises(ConfigError) as fabric:
        CheckpointSaver(root, SaveConfig(run_id="run-b", front_door="fabric"))
    assert "fabric.load('latest', state)" in str(fabric.value) and "ckpt_path" not in str(fabric.value)
    with pytest.raises(ConfigError, match="front_door='keras' is unknown"):
        SaveConfig(front_door="keras")
    # the callback's plan (checkpoint_plan's default) and the Checkpointer's say which advice their savers give
    plan = checkpoint_plan(root, SaveConfig(), LoadConfig(), False, PluginList([]), Placement())
    assert plan.save.front_door == "lightning"
    with Checkpointer(str(tmp_path / "other")) as ckpt:
        assert ckpt.plan.save.front_door == "checkpointer"


def test_a_preemption_signal_saves_the_step_blocking_and_asks_the_loop_to_stop(tmp_path):
    root, run, before = str(tmp_path / "run"), Run(), signal.getsignal(signal.SIGTERM)
    with Checkpointer(root, every_n_steps=100, save_on_preemption=True, preemption_grace_s=None) as ckpt:
        run.train_step()
        assert ckpt.maybe_save(1, run.state) is None and not ckpt.should_stop
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only records it: the process goes on
        run.train_step()
        pending = ckpt.maybe_save(2, run.state)
        assert pending is not None and pending.done() and pending.result().committed  # blocking: committed now
        assert ckpt.should_stop
    assert signal.getsignal(signal.SIGTERM) == before  # put back at close
    assert [entry.step for entry in committed(root)] == [2]


@pytest.mark.slow  # starts a Python process of its own
def test_the_checkpointer_saves_and_resumes_where_lightning_is_not_installed(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
            sys.modules[name] = None  # `import lightning` raises ImportError, as if it were not installed
        import torch
        from lightning_shardckpt import Checkpointer, ResumableDistributedSampler

        model = torch.nn.Linear(3, 2)
        sampler = ResumableDistributedSampler(list(range(10)), num_replicas=1, rank=0)
        sampler.mark_consumed(2, 2)
        with Checkpointer({str(tmp_path / "run")!r}, sampler=sampler) as ckpt:
            ckpt.save(1, {{"model": model}})
        fresh, again = torch.nn.Linear(3, 2), ResumableDistributedSampler(list(range(10)), num_replicas=1, rank=0)
        with Checkpointer({str(tmp_path / "run")!r}, sampler=again) as ckpt:
            assert ckpt.load({{"model": fresh}}) == 1
        assert torch.equal(fresh.weight, model.weight) and again.global_position == 4
        assert "lightning" not in {{name.split(".")[0] for name, module in sys.modules.items() if module}}
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]


@pytest.mark.slow  # starts a Python process of its own
def test_tiers_and_drills_work_as_with_the_callback_and_a_new_node_resumes_from_the_durable_tier(tmp_path):
    fast, durable, run = str(tmp_path / "fast"), str(tmp_path / "durable"), Run()
    logged: list[dict] = []
    tiers = {"fast": {"dirpath": fast, "keep_last": 1}, "durable": {"dirpath": durable, "every_n_checkpoints": 1}}
    drill = {"every_n_checkpoints": 2, "world_size": 1}
    with Checkpointer(every_n_steps=1, tiers=tiers, drill=drill, log_metrics=lambda v, s: logged.append(v)) as ckpt:
        for step in range(1, 3):
            run.train_step()
            ckpt.maybe_save(step, run.state)
    # close waited for the copy and the drill: both checkpoints on the durable tier, step 2 drilled (last-good)
    assert [entry.step for entry in committed(durable)] == [1, 2]
    assert [entry.step for entry in committed(fast)] == [2]
    assert find(resolve(fast), "last-good").step == 2
    assert any(values.get("drill/ok") == 1.0 for values in logged)
    fresh = Run(seed=5)
    node = {"fast": {"dirpath": str(tmp_path / "other_node")}, "durable": {"dirpath": durable}}
    with Checkpointer(tiers=node) as ckpt:
        assert ckpt.load(fresh.state) == 2  # the new node's fast tier is empty: read from the durable tier
    assert torch.equal(fresh.model[0].weight, run.model[0].weight)


def save_in_the_trainers_layout(root: str, run: Run, step: int) -> None:
    """What ShardedStrategy writes: "model", "optimizers.0", a pickled "lightning" section; no "checkpointer"."""
    saver = CheckpointSaver(root, SaveConfig(front_door="lightning"))
    state = {
        "model": get_model_state_dict(run.model),
        "optimizers": {"0": get_optimizer_state_dict(run.model, run.optimizer)},
        "lightning": pickle.dumps({"global_step": step, "loops": {}}),
    }
    assert saver.save(state, step).result().committed
    saver.close()


def test_a_trainer_layout_checkpoint_loads_the_model_and_its_one_optimizer_and_warns_what_it_lacks(tmp_path, caplog):
    root, trained = str(tmp_path / "trainer"), Run()
    for _ in range(3):
        trained.train_step()
    save_in_the_trainers_layout(root, trained, 3)
    fresh = Run(seed=7)
    with Checkpointer(str(tmp_path / "plain"), sampler=fresh.sampler) as ckpt:
        with caplog.at_level(logging.WARNING, logger="lightning_shardckpt.training.checkpointer"):
            assert ckpt.load({"net": fresh.model, "optim": fresh.optimizer}, which=root) == 3
        assert ckpt.not_restored == ("the sampler's position", "the RNG states")
    expected = get_optimizer_state_dict(trained.model, trained.optimizer)
    loaded = get_optimizer_state_dict(fresh.model, fresh.optimizer)
    for name, value in trained.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], value), name
    for name, moments in expected["state"].items():
        for key, value in moments.items():
            assert torch.equal(torch.as_tensor(loaded["state"][name][key]), torch.as_tensor(value)), (name, key)
    warning = " ".join(record.getMessage() for record in caplog.records)
    assert "the Trainer" in warning and "state['optim'] <- 'optimizers.0'" in warning and "RNG" in warning
    assert fresh.sampler.global_position == 0  # not restored, and said so


def test_what_another_doors_checkpoint_lacks_fails_unless_strict_false_which_keeps_and_names_it(tmp_path):
    root, trained = str(tmp_path / "trainer"), Run()
    save_in_the_trainers_layout(root, trained, 1)
    fresh = Run(seed=7)
    with Checkpointer(str(tmp_path / "plain"), restore_rng=False) as ckpt:
        with pytest.raises(IncompatibleCheckpoint, match=r"(?s)not in the checkpoint.*sched.*strict=False"):
            ckpt.load(fresh.state, which=root)
        last_epoch = fresh.scheduler.last_epoch
        assert ckpt.load(fresh.state, which=root, strict=False) == 1
        assert ckpt.not_restored == ("state['sched']", "state['progress']")
    assert fresh.scheduler.last_epoch == last_epoch and fresh.state["progress"] == {"seen": 0}
    assert torch.equal(fresh.model[0].weight, trained.model[0].weight)


def test_an_optimizer_is_not_guessed_among_several_saved_ones(tmp_path):
    root, run = str(tmp_path / "two"), Run()
    saver = CheckpointSaver(root, SaveConfig())
    optimizer_state = get_optimizer_state_dict(run.model, run.optimizer)
    state = {"model": get_model_state_dict(run.model), "optimizers": {"0": optimizer_state, "1": optimizer_state}}
    assert saver.save(state, 1).result().committed
    saver.close()
    other = Run(seed=2)
    with Checkpointer(str(tmp_path / "plain")) as ckpt:
        with pytest.raises(IncompatibleCheckpoint, match=r"(?s)not in the checkpoint.*optim\.param_groups"):
            ckpt.load({"model": other.model, "optim": other.optimizer}, which=root)
        assert ckpt.load({"model": run.model}, which=root) == 1  # the model alone maps


class IntKeyed:
    """A stateful object of the user's whose state dict is keyed by layer number."""

    def __init__(self, scale: float) -> None:
        self.per_layer = {0: torch.full((2,), scale), 1: torch.full((3,), 2 * scale)}
        self.counts = {0: int(scale), 7: -int(scale)}

    def state_dict(self) -> dict:
        return {"per_layer": self.per_layer, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        assert set(state["per_layer"]) == {0, 1} and set(state["counts"]) == {0, 7}, state
        self.per_layer, self.counts = state["per_layer"], dict(state["counts"])


def test_plain_values_and_state_dicts_with_non_string_keys_round_trip_exactly(tmp_path):
    root = str(tmp_path / "run")
    saved = {
        "model": torch.nn.Linear(2, 2),
        "counts": {0: 11, 1: 22},
        "nested": {"by_layer": {0: {"tokens": 5}, (1, 2): torch.arange(3.0)}, "flags": {True: "yes"}},
        "user": IntKeyed(3.0),
    }
    with Checkpointer(root) as ckpt:
        ckpt.save(1, saved, blocking=True)
    counts, by_layer = {0: -1, 1: -1}, {0: {"tokens": -1}, (1, 2): torch.zeros(3)}
    target = {
        "model": torch.nn.Linear(2, 2),
        "counts": counts,
        "nested": {"by_layer": by_layer, "flags": {True: "no"}},
        "user": IntKeyed(0.0),
    }
    with Checkpointer(root) as ckpt:
        assert ckpt.load(target, strict=True) == 1
    assert target["counts"] == {0: 11, 1: 22} and target["counts"] is counts  # refilled in place, own keys only
    assert target["nested"]["by_layer"] is by_layer and by_layer[0] == {"tokens": 5}
    assert list(by_layer) == [0, (1, 2)] and torch.equal(by_layer[(1, 2)], torch.arange(3.0))
    assert target["nested"]["flags"] == {True: "yes"}
    assert target["user"].counts == {0: 3, 7: -3} and torch.equal(target["user"].per_layer[1], torch.full((3,), 6.0))


@pytest.mark.parametrize(
    "values, first, second",
    [
        ({"cfg": {"lr.decay": 0.1, "lr": {"decay": 0.2}}}, "state['cfg']['lr.decay']", "state['cfg']['lr']['decay']"),
        ({"counts": {0: 1, "0": 2}}, "state['counts'][0]", "state['counts']['0']"),
        ({"a.b": 1, "a": {"b": 2}}, "state['a.b']", "state['a']['b']"),
    ],
)
def test_a_state_with_two_values_under_one_name_is_refused_at_the_first_save_naming_both(
    tmp_path, values, first, second
):
    root = tmp_path / "run"
    with Checkpointer(str(root)) as ckpt:
        with pytest.raises(ConfigError) as refused:
            ckpt.save(1, {"model": torch.nn.Linear(2, 2), **values}, blocking=True)
    message = str(refused.value)
    assert "\n" not in message and first in message and second in message and "rename" in message
    assert committed(str(root)) == [] and not list(root.glob("step-*"))  # nothing written, nothing to fail later


def test_a_value_a_load_would_refuse_is_named_at_the_first_save_that_holds_it_with_the_options(tmp_path, caplog):
    from tests.unit.test_untrusted_checkpoints import Opaque

    root = str(tmp_path / "run")
    state = {"model": torch.nn.Linear(2, 2), "user": Opaque(7), "notes": {"n": 1}}
    caplog.set_level(logging.WARNING, logger="lightning_shardckpt.training.loadable")
    with Checkpointer(root) as ckpt:
        ckpt.save(1, state, blocking=True)
        ckpt.save(2, state, blocking=True)
    warned = [r.getMessage() for r in caplog.records if r.name == "lightning_shardckpt.training.loadable"]
    assert len(warned) == 1, warned  # the first save holding it, not every save
    assert "state['user']" in warned[0] and "test_untrusted_checkpoints.Opaque" in warned[0]
    assert "Checkpointer(..., trust_checkpoint=True)" in warned[0] and "add_safe_globals([Opaque])" in warned[0]
    caplog.clear()
    with Checkpointer(str(tmp_path / "trusted"), trust_checkpoint=True) as ckpt:  # its loads will load it
        ckpt.save(1, state, blocking=True)
    torch.serialization.add_safe_globals([Opaque])
    try:
        with Checkpointer(str(tmp_path / "allowed")) as ckpt:
            ckpt.save(1, state, blocking=True)
    finally:
        torch.serialization.clear_safe_globals()
    assert [r for r in caplog.records if r.name == "lightning_shardckpt.training.loadable"] == []


class Phase(enum.IntEnum):
    """An int a load refuses: its class is the user's."""

    WARMUP = 1


def test_a_subclass_of_a_builtin_is_named_at_save_and_plain_values_are_not(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="lightning_shardckpt.training.loadable")
    state = {
        "model": torch.nn.Linear(2, 2),
        "phase": Phase.WARMUP,  # an int to isinstance, a class of the user's to a load
        "plain": {"perm": list(range(1000)), "seen": {1, 2}, "pairs": [(1, "a"), {"x": [1.5, None, b"z"]}]},
        "frozen": frozenset({1}),  # a builtin torch's weights_only loader does not allow
    }
    with Checkpointer(str(tmp_path / "run")) as ckpt:
        ckpt.save(1, state, blocking=True)
    warned = [r.getMessage() for r in caplog.records if r.name == "lightning_shardckpt.training.loadable"]
    assert len(warned) == 2, warned
    assert "state['phase']" in warned[0] and f"{__name__}.Phase" in warned[0]
    assert "state['frozen']" in warned[1] and "builtins.frozenset" in warned[1]
    with pytest.raises(UntrustedCheckpoint) as refused:  # as it said
        with Checkpointer(str(tmp_path / "run")) as ckpt:
            ckpt.load({"model": torch.nn.Linear(2, 2), "phase": 0, "plain": {}, "frozen": None})
    assert refused.value.blocked in (f"{__name__}.Phase", "builtins.frozenset")
