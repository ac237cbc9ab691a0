"""What one save costs each rank in S3 requests, counted on the wire (issue 35).

Two gloo ranks save FSDP2-shaped state (300 row-sharded tensors) to moto's S3 server on loopback, through the
loopback proxy that records every request (tests/helpers/s3_server.py's FaultProxy: the request counter the S3
tests share). Beyond uploading its shard, each rank may make at most three requests: its part's PUT and the
read-back, which is one ranged GET per contiguous span read (a sampled run is one span, or two where it wraps
past the file's end; `full` is one) and whose Content-Range gives the stored size, so no HEAD. Before, the
sampled read-back cost one GET per sampled chunk and a HEAD for the size (PUT 2, HEAD 1, GET 3 per rank here).
With the read-back off, the size check is the one HEAD. A format-v2 save (the coordinator checks every file's
size) takes each size from its rank's read-back too: no HEAD at all, where rank 0 sent one per rank's file.
"""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_shardckpt import CheckpointSaver, SaveConfig
from lightning_shardckpt.engine.config import VerifyConfig
from tests.helpers.checkpoints import dirname_regex
from tests.helpers.spawn import run_ranks

WORLD = 2
TENSORS = 300  # 1% of a rank's bytes is several of its chunks: the old read-back made one GET per chunk
MODES = {1: ("sample", 4), 2: ("full", 4), 3: ("off", 4), 4: ("sample", 2)}  # step -> (verify.mode, format)


def _state(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    model = {}
    for index in range(TENSORS):
        full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + index
        local = torch.chunk(full, world_size)[rank].clone()
        model[f"layer{index:03d}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], shape=full.shape, stride=full.stride()
        )
    return {"model": model, "progress": {"global_step": 7}}


def save_each_mode(rank, world_size, url, storage_options):
    state = _state(rank, world_size)
    for step, (mode, format_version) in MODES.items():
        config = SaveConfig(
            format_version=format_version,
            async_save=False,
            write_events=False,
            storage_options=storage_options,
            run_id="s3-requests",
            verify=VerifyConfig(mode=mode),
        )
        saver = CheckpointSaver(url, config)
        result = saver.save(state, step=step).result(timeout=120)
        saver.close()
        assert result.committed, result.error


def _per_rank(proxy, step: int, rank: int) -> Counter:
    """(method, file kind) -> count of the requests on rank `rank`'s own files of step `step`'s checkpoint."""
    pattern = "/" + dirname_regex(step) + rf"/__{rank}_0\.(distcp|part\.json)"
    counted: Counter = Counter()
    for request in proxy.requests(pattern=pattern):
        kind = re.search(pattern, request.path).group(1)
        counted[(request.method, kind)] += 1
    return counted


def test_each_rank_of_a_save_on_s3_makes_at_most_three_requests_beyond_its_shard_upload(
    s3_server, s3_root, s3_fault_proxy
):
    options = s3_server.storage_options(s3_fault_proxy.endpoint)
    run_ranks(save_each_mode, WORLD, s3_root.url, options, timeout_s=240)

    for rank in range(WORLD):
        sample, full, off, v2 = (_per_rank(s3_fault_proxy, step, rank) for step in MODES)
        upload = {("PUT", "distcp"): 1}  # a shard this small is one PUT (a large one: its multipart parts)
        # sampled: the part's PUT and the read-back's one or two ranged GETs (two only when the run wraps)
        assert sample[("GET", "distcp")] in (1, 2), (rank, sample)
        assert sample == {**upload, ("PUT", "part.json"): 1, ("GET", "distcp"): sample[("GET", "distcp")]}, rank
        assert sum(sample.values()) - 1 <= 3
        # full: every chunk read back, in one streamed GET of the whole file
        assert full == {**upload, ("PUT", "part.json"): 1, ("GET", "distcp"): 1}, (rank, full)
        # off: nothing read back; the stored size is the one HEAD
        assert off == {**upload, ("PUT", "part.json"): 1, ("HEAD", "distcp"): 1}, (rank, off)
        # format v2: no part; the coordinator's size check of this rank's file reads the rank's receipt
        assert v2[("GET", "distcp")] in (1, 2), (rank, v2)
        assert v2 == {**upload, ("GET", "distcp"): v2[("GET", "distcp")]}, (rank, v2)
