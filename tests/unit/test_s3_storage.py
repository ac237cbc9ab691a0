"""The commit protocol on S3 through s3fs, against moto's server on loopback (real HTTP, real s3fs).

Transient and persistent failures come from a loopback proxy in front of moto that answers S3 errors
for the requests it is told to fail.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from lightning_shardckpt import CheckpointSaver, SaveConfig, StorageUnavailable, load_checkpoint
from lightning_shardckpt.engine.catalog import list_checkpoints, read_latest_pointer, resolve_latest
from lightning_shardckpt.engine.config import LoadConfig
from lightning_shardckpt.engine.format.names import checkpoint_dirname
from lightning_shardckpt.engine.storage import backends, retry
from lightning_shardckpt.engine.storage.fsio import create_if_absent, makedirs, preflight, resolve

# botocore's own per-request retries off: the proxy's errors reach s3fs and our layer at once
NO_HTTP_RETRIES = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}


def model_state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 64, generator=gen), "b": torch.randn(64, generator=gen).to(torch.bfloat16)},
        "optim": {"step": torch.tensor(seed), "m": torch.randn(300, generator=gen, dtype=torch.float64)},
        "progress": {"step": seed, "note": "s3"},
    }


def zeros_like(state: dict) -> dict:
    return {
        key: zeros_like(value)
        if isinstance(value, dict)
        else torch.zeros_like(value)
        if isinstance(value, torch.Tensor)
        else None
        for key, value in state.items()
    }


def save_one(url: str, options: dict, state: dict, step: int):
    """One save through the background thread, as training does; returns its SaveResult."""
    saver = CheckpointSaver(url, SaveConfig(storage_options=options, run_id="s3-test-run"))  # one run, many savers
    try:
        return saver.save(state, step=step).result(timeout=60)
    finally:
        saver.close()


def assert_same(loaded: dict, saved: dict) -> None:
    for key, value in saved.items():
        if isinstance(value, dict):
            assert_same(loaded[key], value)
        elif isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def test_save_then_load_round_trips_bit_exact_on_s3(s3_server, s3_root, s3_fault_proxy):
    # 5 MiB blocks (S3's smallest part): the 6 MiB shard goes up as a multipart upload, as big shards do
    options = s3_server.storage_options(s3_fault_proxy.endpoint, default_block_size=5 * 2**20)
    state = model_state(3)
    state["model"]["big"] = torch.randn(6 * 2**20 // 4, generator=torch.Generator().manual_seed(1))
    result = save_one(s3_root.url, options, state, step=3)
    assert result.committed, result.error
    assert s3_fault_proxy.requests("POST", r"__0_0\.distcp\?uploadId="), "the shard was not a multipart upload"

    target = zeros_like(state)
    target["progress"] = {"step": 0, "note": ""}
    loaded = load_checkpoint(target, s3_root.url, config=LoadConfig(storage_options=s3_root.storage_options))
    assert loaded.step == 3
    assert_same(target, state)
    location = resolve(s3_root.url, s3_root.storage_options)
    assert read_latest_pointer(location) == resolve_latest(location).name


def test_plain_dcp_fsspec_reader_loads_our_s3_checkpoint(s3_root):
    state = model_state(5)
    result = save_one(s3_root.url, s3_root.storage_options, state, step=5)
    assert result.committed, result.error

    target = {"model": {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16)}}
    dcp.load(target, storage_reader=FsspecReader(result.path, **s3_root.storage_options))
    assert_same(target["model"], state["model"])


def test_manifest_create_sends_if_none_match_and_a_second_create_is_refused(s3_server, s3_root, s3_fault_proxy):
    options = s3_server.storage_options(s3_fault_proxy.endpoint)
    fs = resolve(s3_root.url, options).fs
    path = f"{s3_root.bucket}/{s3_root.prefix}/manifest.json"

    create_if_absent(fs, path, b"first")
    with pytest.raises(FileExistsError):
        create_if_absent(fs, path, b"second")

    puts = s3_fault_proxy.requests("PUT", r"/manifest\.json")
    assert [r.headers.get("if-none-match") for r in puts] == ["*", "*"]
    assert s3_server.object_bytes(s3_root.bucket, f"{s3_root.prefix}/manifest.json") == b"first"


def test_a_big_multipart_create_is_conditional_and_leaves_no_upload_behind(
    s3_server, s3_root, s3_fault_proxy, monkeypatch
):
    monkeypatch.setattr(backends.S3Backend, "multipart_chunk_bytes", 5 * 2**20)  # S3's smallest part: 11 MiB is 3 parts
    options = s3_server.storage_options(s3_fault_proxy.endpoint)
    fs = resolve(s3_root.url, options).fs
    path = f"{s3_root.bucket}/{s3_root.prefix}/big.json"
    big = torch.randint(0, 255, (11 * 2**20,), dtype=torch.uint8).numpy().tobytes()

    create_if_absent(fs, path, big)
    with pytest.raises(FileExistsError):
        create_if_absent(fs, path, big[:-1] + b"x")

    assert len(s3_fault_proxy.requests("PUT", r"/big\.json\?partNumber=3&")) == 2
    completes = s3_fault_proxy.requests("POST", r"/big\.json\?uploadId=")
    assert len(completes) == 2 and all(r.headers.get("if-none-match") == "*" for r in completes)
    assert [u for u in s3_server.multipart_uploads(s3_root.bucket) if u["Key"].startswith(s3_root.prefix)] == []
    assert fs.size(path) == len(big)


def test_two_writers_racing_for_one_manifest_exactly_one_wins(s3_server, s3_root):
    path = f"{s3_root.bucket}/{s3_root.prefix}/{checkpoint_dirname(1, 'abcdef012345')}/manifest.json"
    # two filesystems, as two processes would have: neither sees the other's state
    writers = [resolve(s3_root.url, s3_server.storage_options(skip_instance_cache=True)).fs for _ in range(2)]
    barrier, outcomes = threading.Barrier(2), {}

    def commit(index: int) -> None:
        barrier.wait()
        try:
            create_if_absent(writers[index], path, f"writer {index}".encode())
            outcomes[index] = "won"
        except FileExistsError:
            outcomes[index] = "refused"

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes.values()) == ["refused", "won"]
    winner = [i for i, outcome in outcomes.items() if outcome == "won"][0]
    assert s3_server.object_bytes(s3_root.bucket, path.split("/", 1)[1]) == f"writer {winner}".encode()


def test_listings_after_a_commit_by_another_process_are_fresh(s3_server, s3_root):
    reader = resolve(s3_root.url, s3_root.storage_options)
    cached = resolve(s3_root.url, s3_server.storage_options(skip_instance_cache=True))
    cached.fs.dircache.listings_expiry_time = None  # what s3fs does by default: cache listings forever
    cached.fs.dircache.use_listings_cache = True
    save_one(s3_root.url, s3_server.storage_options(skip_instance_cache=True), model_state(1), step=1)
    assert [e.step for e in list_checkpoints(reader)] == [1]
    assert [e.step for e in list_checkpoints(cached)] == [1]

    # another process (its own filesystem instance) commits step 2
    save_one(s3_root.url, s3_server.storage_options(skip_instance_cache=True), model_state(2), step=2)

    assert [e.step for e in list_checkpoints(reader)] == [1, 2]
    assert resolve_latest(reader).step == 2
    # the control: a listing cache, s3fs's default, would have hidden the new checkpoint
    assert [e.step for e in list_checkpoints(cached)] == [1]


def test_makedirs_on_s3_never_creates_a_bucket(s3_server):
    location = resolve("s3://no-such-bucket-here/run", s3_server.storage_options())
    makedirs(location.fs, location.path)
    assert not location.fs.exists("no-such-bucket-here")


def test_transient_503s_on_the_commit_are_retried_and_counted(s3_server, s3_root, s3_fault_proxy, fast_retries):
    options = s3_server.storage_options(s3_fault_proxy.endpoint, **NO_HTTP_RETRIES)
    s3_fault_proxy.fail("PUT", r"/manifest\.json$", times=2)  # two 503s on the commit itself
    s3_fault_proxy.fail("GET", r"__0_0\.distcp", times=1)  # one on the read-back verification
    s3_fault_proxy.fail("PUT", r"/latest$", times=1)
    before = retry.counters.snapshot()

    result = save_one(s3_root.url, options, model_state(7), step=7)

    assert result.committed, result.error
    after = retry.counters.snapshot()
    grew = {key: after.get(key, 0) - before.get(key, 0) for key in after if after.get(key, 0) != before.get(key, 0)}
    assert grew == {"retried.create_if_absent": 2, "retried.read_range": 1, "retried.put": 1}
    assert [f.hits for f in s3_fault_proxy.faults] == [2, 1, 1]
    assert result.storage_retries == 4  # what the checkpoint's metrics record reports (checkpoint/storage_retries)


def test_botocore_retries_a_503_itself_and_the_retry_is_counted(s3_server, s3_root, s3_fault_proxy):
    options = s3_server.storage_options(s3_fault_proxy.endpoint)  # botocore's default retries on
    s3_fault_proxy.fail("PUT", r"/manifest\.json$", times=1)
    before = retry.counters.total("http_retries.")

    result = save_one(s3_root.url, options, model_state(8), step=8)

    assert result.committed, result.error
    assert retry.counters.total("http_retries.") - before >= 1


def test_a_create_whose_response_was_lost_is_recognised_as_ours(s3_server, s3_root, s3_fault_proxy, fast_retries):
    options = s3_server.storage_options(s3_fault_proxy.endpoint, **NO_HTTP_RETRIES)
    # the manifest lands, but its response is a 503: the retry meets 412 on its own object
    s3_fault_proxy.fail("PUT", r"/manifest\.json$", times=1, after_forward=True)
    before = retry.counters.snapshot().get("recovered.create_if_absent", 0)

    result = save_one(s3_root.url, options, model_state(9), step=9)

    assert result.committed, result.error
    assert retry.counters.snapshot()["recovered.create_if_absent"] == before + 1
    manifest_puts = s3_fault_proxy.requests("PUT", r"/manifest\.json$")
    assert len(manifest_puts) == 2 and manifest_puts[0].faulted


def test_a_persistent_error_fails_that_save_only_and_the_next_one_commits(
    s3_server, s3_root, s3_fault_proxy, fast_retries
):
    options = s3_server.storage_options(s3_fault_proxy.endpoint, **NO_HTTP_RETRIES)
    fault = s3_fault_proxy.fail("PUT", r"__0_0\.distcp", times=None)  # the shard upload never succeeds
    saver = CheckpointSaver(s3_root.url, SaveConfig(storage_options=options))
    first = saver.save(model_state(1), step=1).result(timeout=60)
    s3_fault_proxy.faults.remove(fault)  # the outage ends
    second = saver.save(model_state(2), step=2).result(timeout=60)
    saver.close()

    assert not first.committed and "injected by FaultProxy" in str(first.error)
    assert second.committed, second.error
    assert saver.counters.snapshot() == {"attempted": 2, "committed": 1, "failed": 1, "skipped": 0}
    states = {e.step: e.state for e in list_checkpoints(resolve(s3_root.url, s3_root.storage_options))}
    assert states == {1: "uncommitted", 2: "committed"} or states == {2: "committed"}


def test_a_persistent_error_on_the_manifest_gives_up_after_the_bounded_attempts(
    s3_server, s3_root, s3_fault_proxy, fast_retries
):
    options = s3_server.storage_options(s3_fault_proxy.endpoint, **NO_HTTP_RETRIES)
    fault = s3_fault_proxy.fail("PUT", r"/manifest\.json$", times=None, code="InternalError", status=500)
    before = retry.counters.snapshot().get("gave_up.create_if_absent", 0)

    result = save_one(s3_root.url, options, model_state(4), step=4)

    assert not result.committed and "injected by FaultProxy" in str(result.error)
    assert fault.hits == fast_retries.attempts
    assert retry.counters.snapshot()["gave_up.create_if_absent"] == before + 1
    assert resolve_latest(resolve(s3_root.url, s3_root.storage_options)) is None


def test_preflight_passes_and_leaves_nothing_behind(s3_server, s3_root):
    preflight(resolve(s3_root.url, s3_root.storage_options))
    assert s3_server.fs.find(f"{s3_root.bucket}/{s3_root.prefix}") == []


def test_preflight_names_a_missing_bucket_and_the_fix(s3_server):
    location = resolve("s3://no-such-bucket/run-1", s3_server.storage_options())
    with pytest.raises(
        StorageUnavailable, match=r"bucket 'no-such-bucket' does not exist: create it or fix dirpath"
    ) as caught:
        preflight(location)
    assert "s3://no-such-bucket/run-1" in str(caught.value)


def test_preflight_names_rejected_credentials_and_the_fix(s3_server, s3_root):
    location = resolve(s3_root.url, s3_server.storage_options(key="AKIAWRONGWRONGWRONG1", secret="nope"))
    with s3_server.enforce_auth():
        with pytest.raises(
            StorageUnavailable, match=r"credentials rejected .*set storage_options key/secret or AWS_\* env vars"
        ) as caught:
            preflight(location)
    assert s3_root.url in str(caught.value) and "InvalidAccessKeyId" in str(caught.value)


def test_a_shard_upload_failing_mid_multipart_is_aborted_not_left_behind(
    s3_server, s3_root, s3_fault_proxy, fast_retries
):
    # 5 MiB parts (S3's smallest) so a 6 MiB shard is a multipart upload; its second part always fails
    options = s3_server.storage_options(s3_fault_proxy.endpoint, default_block_size=5 * 2**20, **NO_HTTP_RETRIES)
    s3_fault_proxy.fail("PUT", r"__0_0\.distcp\?partNumber=2&", times=None)
    state = {"w": torch.randn(6 * 2**20 // 4, generator=torch.Generator().manual_seed(0))}

    result = save_one(s3_root.url, options, state, step=1)

    assert not result.committed
    assert len(s3_fault_proxy.requests("PUT", r"__0_0\.distcp\?partNumber=1&")) == 1  # it was a multipart upload
    assert [u["Key"] for u in s3_server.multipart_uploads(s3_root.bucket) if u["Key"].startswith(s3_root.prefix)] == []
    assert not s3_server.fs.exists(f"{s3_root.bucket}/{s3_root.prefix}/{result.path.rsplit('/', 1)[-1]}/__0_0.distcp")


def test_preflight_names_an_unreachable_endpoint(s3_server):
    closed_port = "http://127.0.0.1:1"
    options = s3_server.storage_options(closed_port, **NO_HTTP_RETRIES)  # s3fs still tries 5 times (~2 s)
    with pytest.raises(StorageUnavailable, match=r"cannot reach http://127\.0\.0\.1:1 .*check endpoint_url"):
        preflight(resolve("s3://any-bucket/run", options))


def test_preflight_on_a_local_root_creates_it_and_leaves_nothing_behind(tmp_path):
    root = tmp_path / "ckpt"
    preflight(resolve(str(root)))
    assert root.is_dir() and list(root.iterdir()) == []


def test_transient_and_permanent_errors_are_told_apart():
    from botocore.exceptions import ClientError, EndpointConnectionError

    def s3_error(code: str, status: int) -> OSError:
        err = OSError(5, code)
        err.__cause__ = ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )
        return err

    for transient in (
        s3_error("ServiceUnavailable", 503),
        s3_error("SlowDown", 503),
        s3_error("InternalError", 500),
        s3_error("RequestTimeout", 400),
        OSError(16, "busy"),
        TimeoutError(),
        ConnectionResetError(),
        EndpointConnectionError(endpoint_url="http://x"),
    ):
        assert retry.is_transient(transient), transient
    for permanent in (
        s3_error("AccessDenied", 403),
        s3_error("NoSuchBucket", 404),
        FileNotFoundError("x"),
        FileExistsError("x"),
        PermissionError("x"),
        ValueError("x"),
    ):
        assert not retry.is_transient(permanent), permanent


def test_retry_backoff_is_bounded_and_exponential():
    policy = retry.RetryPolicy(attempts=6, base_s=0.5, max_s=4.0, jitter=False)
    assert [policy.backoff_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="attempts=0"):
        retry.RetryPolicy(attempts=0)


@pytest.mark.distributed  # spawns a gloo rank (tests.helpers.spawn): ~10 s
def test_the_callback_refuses_an_unreachable_root_before_training_starts():
    from tests.helpers.lightning_run import preflight_on_rank
    from tests.helpers.spawn import run_ranks

    options = {
        "endpoint_url": "http://127.0.0.1:9",
        "key": "k",
        "secret": "s",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    outcome = run_ranks(preflight_on_rank, 1, "s3://no-such-bucket-here/run", options)[0].value
    assert outcome["error"].startswith("StorageUnavailable") and "no-such-bucket-here" in outcome["error"]
    assert outcome["global_step"] == 0
