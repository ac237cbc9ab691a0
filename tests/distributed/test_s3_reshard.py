"""Save on 2 gloo ranks to S3 (moto on loopback, reached by every rank over HTTP), load on 3."""

from __future__ import annotations

from lightning_shardckpt import CheckpointSaver, LoadConfig, SaveConfig, VerifyConfig, load_checkpoint
from lightning_shardckpt.engine.catalog import list_checkpoints, read_latest_pointer
from lightning_shardckpt.engine.storage.fsio import resolve
from tests.helpers import training_state as ts
from tests.helpers.spawn import run_ranks


def save_worker(rank, world_size, url, storage_options):
    model, optimizer = ts.build("fsdp", seed=1, world_size=world_size)
    ts.train_steps(model, optimizer, steps=2, seed=2)
    state = ts.sharded_state(model, optimizer)
    state["progress"] = {"global_step": 2, "note": "saved-on-s3"}
    config = SaveConfig(verify=VerifyConfig(mode="full"), parallelism="fsdp", storage_options=storage_options)
    saver = CheckpointSaver(url, config)
    result = saver.save(state, step=2, epoch=0).result(timeout=60)
    assert result.committed, result.error
    saver.close()
    full = ts.full_state(model, optimizer)  # a collective: every rank takes part
    return full if rank == 0 else result.bytes_rank


def load_worker(rank, world_size, url, storage_options):
    model, optimizer = ts.build("fsdp", seed=99, world_size=world_size)  # different init on purpose
    state = ts.sharded_state(model, optimizer)
    state["progress"] = {"global_step": 0, "note": ""}
    result = load_checkpoint(state, url, config=LoadConfig(storage_options=storage_options))
    ts.apply_state(model, optimizer, state)
    return {"full": ts.full_state(model, optimizer), "progress": state["progress"], "step": result.step}


def test_checkpoint_saved_on_2_ranks_to_s3_loads_bit_exact_on_3(s3_root):
    saved = run_ranks(save_worker, 2, s3_root.url, s3_root.storage_options)
    assert saved[1].value > 0, "rank 1 wrote no shard of its own"

    location = resolve(s3_root.url, s3_root.storage_options)
    [entry] = list_checkpoints(location)
    assert entry.committed and read_latest_pointer(location) == entry.name
    assert {f["path"] for f in entry.manifest["files"]} >= {"__0_0.distcp", "__1_0.distcp"}

    loaded = run_ranks(load_worker, 3, s3_root.url, s3_root.storage_options)
    ts.assert_bit_exact(saved[0].value, loaded[0].value["full"])
    for outcome in loaded:
        assert outcome.value["progress"] == {"global_step": 2, "note": "saved-on-s3"}
        assert outcome.value["step"] == 2
