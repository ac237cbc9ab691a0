"""The main recipe (recipes/train.py) as two torchrun "nodes" × 2 ranks on loopback with `tiers=local+s3`, as a
cluster runs one torchrun per node: the environment every node's processes get and one node's command (or its
ranks forked with torchrun's environment: `start_forked_node`). Each node's
fast tier is its own directory under tmp_path/local (`.../node{node_rank}`), the durable tier the loopback S3
server (or a proxy in front of it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.helpers.spawn import ForkedMain, launched_rank_env

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "recipes" / "train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def tiers_env(tmp_path: Path, s3_root, endpoint: str | None = None) -> dict[str, str]:
    """The recipe's `local+s3` tiers pointed at tmp_path/local and `s3_root`'s bucket, through `endpoint` when
    given (a recording proxy) instead of the server's own; no W&B, one thread per rank."""
    options = s3_root.storage_options
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        SHARDCKPT_LOCAL_ROOT=str(tmp_path / "local"),
        SHARDCKPT_S3_BUCKET=s3_root.bucket,
        AWS_ENDPOINT_URL=endpoint or options["endpoint_url"],
        AWS_ACCESS_KEY_ID=options["key"],
        AWS_SECRET_ACCESS_KEY=options["secret"],
    )


def node_command(node: int, port: int, *recipe_args: str) -> list[str]:
    """Node `node` (0 or 1) of two, 2 ranks each, meeting at 127.0.0.1:`port`, running the recipe with `recipe_args`."""
    return [
        str(TORCHRUN),
        "--nnodes=2",
        "--nproc-per-node=2",
        f"--node-rank={node}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(TRAIN),
        "trainer.num_nodes=2",
        "trainer.devices=2",
        *recipe_args,
    ]


def start_forked_node(
    node: int, port: int, recipe_args: list[str], cwd: Path, env: dict, log: Path, *, nodes: int = 2, per_node: int = 2
) -> list[ForkedMain]:
    """Node `node`'s ranks of the recipe with torchrun's environment, forked from the tests' forkserver (torch and
    Lightning imported once, not per rank), every rank's output appended to `log` as torchrun's is. For a test of
    what the ranks do across nodes; how torchrun itself starts and stops a node is tests/e2e/test_tiers_multinode.py's."""
    log.write_text("")
    argv = [str(TRAIN), f"trainer.num_nodes={nodes}", f"trainer.devices={per_node}", *recipe_args]
    ranks = range(node * per_node, (node + 1) * per_node)
    return [
        ForkedMain(
            argv, launched_rank_env(rank, nodes * per_node, port, node=node, local_world=per_node, **env), cwd, log
        )
        for rank in ranks
    ]
