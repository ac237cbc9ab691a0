import os
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

# Ranks and tests run on CPU; keep each process to one BLAS/OpenMP thread on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


# --- S3 on loopback: one moto server per session, a fresh root per test -----------------------------
S3_BUCKET = "shardckpt-test"


@dataclass
class S3Root:
    """A fresh, empty checkpoint root on the session's S3 server."""

    url: str  # s3://bucket/<unique>
    storage_options: dict[str, Any]
    server: Any  # tests.helpers.s3_server.S3Server
    bucket: str
    prefix: str


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (a port of its own), with the test bucket created."""
    from tests.helpers.s3_server import S3Server

    server = S3Server()
    server.create_bucket(S3_BUCKET)
    yield server
    server.stop()


@pytest.fixture
def s3_root(s3_server) -> S3Root:
    prefix = f"run-{uuid.uuid4().hex[:12]}"
    return S3Root(f"s3://{S3_BUCKET}/{prefix}", s3_server.storage_options(), s3_server, S3_BUCKET, prefix)


@pytest.fixture
def s3_fault_proxy(s3_server):
    """A FaultProxy in front of the session's S3 server; reach it with `s3_server.storage_options(proxy.endpoint)`."""
    from tests.helpers.s3_server import FaultProxy

    proxy = FaultProxy(s3_server.host, s3_server.port)
    yield proxy
    proxy.stop()


@pytest.fixture
def fast_retries():
    """Our retry layer with millisecond backoffs, so a test of four attempts takes no time."""
    from lightning_shardckpt.engine.storage import retry

    previous = retry.set_policy(retry.RetryPolicy(attempts=4, base_s=0.01, max_s=0.05))
    yield retry.get_policy()
    retry.set_policy(previous)
