"""Shared fixtures and markers of the test suite.

The suite runs in pieces (markers registered in pyproject.toml):
- `distributed`: spawns real gloo ranks; every test under tests/distributed/ gets it here, by directory.
- `e2e`: runs a recipe or script end to end; every test under tests/e2e/ gets it here, by directory.
- `slow`: a unit test that starts a Python process of its own or runs over ~10 s alone; marked in its file.

  ./scripts/run_tests.sh --fast          the fast lane: tests/unit with `-m "not distributed and not e2e and not slow"`,
                                         on 2 xdist workers, under a minute on a quiet machine
  ./scripts/run_tests.sh -m distributed  one marker (or `-m slow`, `-m e2e`), on the xdist workers
  ./scripts/run_tests.sh tests/unit/test_gc.py -k retention -n 0   one file (and a -k filter) in one process
  ./scripts/run_tests.sh                 everything: what CI runs, nothing deselected, on 4 xdist workers

Running in parallel (pytest-xdist, `-n 4 --dist loadgroup`): a test that uses a module- or class-scoped fixture
gets an `xdist_group` named after its file, so its fixture is built once, on one worker; tests that need one
machine-wide resource share a named group (the documents that start moto on its documented port:
"docs-moto-port"); everything else runs anywhere, e2e first, then distributed, then the slow units, then the rest,
so the long tests start early. A test that must not run beside a given other one says so with
`@pytest.mark.xdist_group(NAME)`.

Fixtures for every test: `backend` (a fresh checkpoint root, run once on local disk and once on the loopback
S3 server), `run_cli` (the `shardckpt` command in-process: exit code, stdout, stderr) and
`committed_checkpoint` (commits a small checkpoint and returns its root, directory and manifest).
"""

import gc
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# No cyclic garbage collection while collection imports torch, Lightning, the package and every test module: each
# full collection would walk the ever larger heap of objects that live as long as the process (~0.7 CPU-s per
# xdist worker). `pytest_collection_finish` freezes them and turns the collector back on; the xdist controller,
# which collects nothing, turns it on in `pytest_configure`.
gc.disable()

# Ranks and tests run on CPU; keep each process to one BLAS/OpenMP thread on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Bytecode caches on, for this process and every one it starts: with PYTHONDONTWRITEBYTECODE set (this machine's
# shell sets it) each of the suite's hundreds of Python processes (ranks, recipes, CLI calls, drills) compiled the
# package, the recipes and tests/helpers from source again, ~0.3 CPU-s each. The caches land in __pycache__/
# (git-ignored), and in each documented-commands test's throwaway copy of the repository.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Every process of the suite at the lowest priority, so the drills it starts (at +19 over their starter, the
# product's default) compete with the tests' own ranks as equals. At nice 0 beside 4 busy xdist workers on 2
# cores a drill got ~1.5 % of a core: a follower's pool took 169 s to import torch (5 CPU-s), and tests that need
# a drill to finish while training runs failed or waited for their timeouts. It also leaves the machine to its
# owner's other work while the suite runs.
os.nice(max(0, 19 - os.nice(0)))

TESTS = Path(__file__).parent
MARKER_BY_DIRECTORY = {TESTS / "distributed": "distributed", TESTS / "e2e": "e2e"}


# The order tests are handed to xdist workers: the long ones first (whole recipes, then spawned ranks, then the
# `slow` units: the model-based test's minute, the CLI's own processes; then the quick units), so no worker picks up
# a 60-second recipe, or the model-based test, while the others have run out of work.
RUN_ORDER = ("e2e", "distributed", "slow")
SHARED_SCOPES = ("module", "class", "package")


def pytest_addoption(parser):
    parser.addoption(
        "--deep",
        action="store_true",
        help="the model-based tests' deep profile (thousands of steps, minutes): tests/unit/test_one_truth_model.py",
    )
    parser.addoption(
        "--deep-seconds",
        type=float,
        default=120.0,
        help="with --deep: how long each model-based test searches (fresh sequences until then; default 120 s)",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns xdist_group marks into work units
def pytest_collection_modifyitems(config, items):
    """Mark by directory, so a new file under tests/distributed/ or tests/e2e/ cannot forget its marker; keep
    the tests that share a module fixture on one xdist worker; hand out the longest tests first."""
    for item in items:
        for directory, marker in MARKER_BY_DIRECTORY.items():
            if item.path.is_relative_to(directory):
                item.add_marker(marker)
        if shares_a_fixture(item) and item.get_closest_marker("xdist_group") is None:
            # one worker runs the whole module, so its fixture (a trained run, a committed root) is built once
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(key=run_order)  # stable: a module's tests stay together and in file order


def pytest_configure(config):
    """The collector back on in the xdist controller (see `gc.disable()` above). Refuse `--dist loadgroup` on pytest
    9: pytest-xdist (3.8) groups by renaming each grouped test's `_nodeid`, which pytest 9 no longer reads. The suite
    still passed that way, but every worker rebuilt each module fixture (a trained recipe run, once per worker) and
    the grouped documents raced for their port."""
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", default=None):
        gc.enable()  # the xdist controller: its workers collect, it never reaches pytest_collection_finish
    if config.getoption("dist", default="no") == "loadgroup" and int(pytest.__version__.split(".")[0]) >= 9:
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist --dist loadgroup groups nothing: install the pytest the "
            "dev extra pins (`bash scripts/setup_env.sh`, or `.venv/bin/pip install 'pytest>=8,<9'`)"
        )


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, Lightning, the package, every test module: a few hundred thousand
    objects) into the permanent generation: the cyclic collector then no longer walks them in every full collection
    of the many that the in-process tests' garbage triggers (tests/helpers/forkserver_gc_freeze.py has the
    measurement for the forked ranks)."""
    gc.freeze()
    gc.enable()


def shares_a_fixture(item) -> bool:
    """Whether the test uses a fixture that outlives it (module or class scope): built once per worker."""
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    if fixtureinfo is None:
        return False
    return any(defs[-1].scope in SHARED_SCOPES for defs in fixtureinfo.name2fixturedefs.values() if defs)


def run_order(item) -> int:
    markers = [marker for marker in RUN_ORDER if item.get_closest_marker(marker)]
    return RUN_ORDER.index(markers[0]) if markers else len(RUN_ORDER)


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


@pytest.fixture(autouse=True)
def a_rendezvous_port_of_its_own(monkeypatch):
    """MASTER_PORT for whatever this test starts that would otherwise pick a port itself: Lightning's and Fabric's
    launchers bind port 0, close it and let rank 0 listen later, and meanwhile any outgoing connection of the suite
    may get that port (the kernel hands both out from one range). spawn.free_port's ports are below that range,
    in a slice of their own per xdist worker. A test that sets its own keeps it."""
    from tests.helpers.spawn import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))


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


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path):
    """A fresh, empty checkpoint root: a local directory, or a prefix on the session's moto S3 server.

    Every test asking for it runs on both; pick some with
    `@pytest.mark.parametrize("backend", [LOCAL], indirect=True)` (names from tests.helpers.backends).
    """
    from tests.helpers.backends import LOCAL, S3, Backend

    if request.param == LOCAL:
        return Backend(LOCAL, str(tmp_path / "ckpt"))
    assert request.param == S3, f"unknown backend {request.param!r}: use tests.helpers.backends.LOCAL or S3"
    s3_root = request.getfixturevalue("s3_root")  # starts moto only for the S3 runs
    return Backend(S3, s3_root.url, s3_root.storage_options)


@pytest.fixture
def fast_retries():
    """Our retry layer with millisecond backoffs, so a test of four attempts takes no time."""
    from lightning_shardckpt.engine.storage import retry

    previous = retry.set_policy(retry.RetryPolicy(attempts=4, base_s=0.01, max_s=0.05))
    yield retry.get_policy()
    retry.set_policy(previous)


# --- the command line and small committed checkpoints, in this process ------------------------------


@pytest.fixture
def run_cli(capsys):
    """`run_cli("ls", root, "--json")` runs the `shardckpt` command in this process and returns
    (exit code, stdout, stderr) of that one call."""
    from lightning_shardckpt.cli.main import main

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()  # only this call's output
        code = main([str(arg) for arg in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def committed_checkpoint(tmp_path):
    """`committed_checkpoint(root=None, step=3, state=None, format_version=4)` commits one small checkpoint (a
    fresh model by default) under `root` (default: tmp_path/"ckpt") in this process and returns a `Committed`
    (root, directory, manifest in the v2 shape); see tests.helpers.checkpoints."""
    from tests.helpers.checkpoints import commit_checkpoint

    def commit(
        root: str | os.PathLike | None = None, step: int = 3, state: dict | None = None, format_version: int = 4
    ):
        root = str(tmp_path / "ckpt" if root is None else root)
        return commit_checkpoint(root, step=step, state=state, format_version=format_version)

    return commit


@pytest.fixture(scope="module")
def drill_pool():
    """One warm drill pool for a module's one-off drills (`run_drill(..., pool=drill_pool)`), as a run's DrillRunner or a
    follower keeps one, instead of a pool started and stopped per drill (an interpreter importing torch, DCP and DTensor:
    ~2.3 CPU-s each, 12 of them in test_restore_drill alone). Its ranks are forked per drill and never kept
    (keep_bytes=0), so no drill sees a process or tensor of an earlier test; a test of the per-drill start itself (the
    CLI's `shardckpt drill CKPT`, a cold `worker_pool` in the record) passes no pool."""
    from lightning_shardckpt.policies.drills.pool import WarmPool

    pool = WarmPool(keep_bytes=0)
    yield pool
    pool.close()


@pytest.fixture
def compose_checkpoint(tmp_path, monkeypatch):
    """`compose_checkpoint(*overrides)`: conf/train.yaml composed with Hydra overrides, its `checkpoint` node
    instantiated as recipes/train.py does (the callback, or the error its options raise)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    conf = Path(__file__).resolve().parents[1] / "conf"
    monkeypatch.chdir(tmp_path)

    def make(*overrides: str):
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        return instantiate(cfg.checkpoint, _partial_=True)(run_config={})

    yield make
    HydraConfig.instance().cfg = None
