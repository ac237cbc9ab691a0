"""What the allocation bounds of issue 37 item 4 and the save checks of items 8 and 9 cost.

    python benchmarks/open_bounds.py                 three runs, ratios min/median/max
    python benchmarks/open_bounds.py --chunks 50000  a smaller manifest and .metadata

Each row times one reader with its bound and the same reader without it, on the same bytes, in one run:
- manifest: `bounded_json.loads` (size, depth and parse-cost bounds) / `json.loads`, a writer-format manifest;
- .metadata: `safe_pickle.load_dcp_metadata` (allow-list + one allowance per pickle) / the allow-list alone
  (`RestrictedUnpickler(size=None)`), and / plain `pickle.loads`, a synthetic DCP Metadata of 64 chunks per tensor;
- object record: `safe_pickle.load_torch_record` (our unpickler, bounded) / `torch.load(weights_only=True)`;
- save checks: on a Trainer-shaped DCP state of 1,000 tensors, in ms per save: `check_keys` (every rank, every save)
  and `SaveChecks` whole (rank 0 with trust off: key collisions + what a load would refuse); and `SaveChecks` on a
  plain loop's state holding a list of a million ints, next to `torch.save` of that list (what DCP pays for it).
Ratios above 1 are what the bound costs. Nothing here is asserted: the numbers go to the report.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import statistics
import time

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_shardckpt.engine.format import bounded_json, safe_pickle
from lightning_shardckpt.engine.format.manifest import to_bytes
from lightning_shardckpt.training.loadable import SaveChecks
from lightning_shardckpt.training.state_keys import check_keys


def best_of(function, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return min(times)


def manifest_bytes(chunks: int) -> bytes:
    per_tensor = 64
    tensors = []
    for t in range(chunks // per_tensor):
        tensors.append(
            {
                "fqn": f"model.layers.{t}.weight",
                "shape": [per_tensor * 8, 4096],
                "dtype": "torch.bfloat16",
                "chunks": [
                    {
                        "offsets": [r * 8, 0],
                        "sizes": [8, 4096],
                        "file": f"__{r}_0.distcp",
                        "offset": t * 70_000,
                        "length": 65_536 + 1_200,
                        "checksum": f"{(t * 977 + r) % (1 << 64):016x}",
                    }
                    for r in range(per_tensor)
                ],
            }
        )
    return to_bytes({"format_version": 2, "tensors": tensors, "objects": [], "files": []})


def metadata_bytes(chunks: int) -> bytes:
    per_tensor, state, storage = 64, {}, {}
    for t in range(chunks // per_tensor):
        fqn = f"model.layers.{t}.weight"
        pieces = [ChunkStorageMetadata(torch.Size([r * 8, 0]), torch.Size([8, 4096])) for r in range(per_tensor)]
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([512, 4096]), pieces)
        for r, piece in enumerate(pieces):
            storage[MetadataIndex(fqn, piece.offsets)] = _StorageInfo(f"__{r}_0.distcp", t * 70_000, 66_736)
    return pickle.dumps(Metadata(state, planner_data={k: tuple(k.split(".")) for k in state}, storage_data=storage))


def object_record() -> bytes:
    value = {"loops": {"fit_loop": {"epoch": 3, "batches": list(range(2_000))}}, "rng": torch.get_rng_state()}
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def trainer_state(tensors: int) -> dict:
    model = {f"net.{i}.weight": torch.zeros(4) for i in range(tensors)}
    blob = pickle.dumps({"hyper_parameters": {"lr": 0.1}, "loops": {"fit_loop": {"epoch": 1}}, "step": 3})
    return {"model": model, "optimizers": {"0": {"state": {}, "param_groups": []}}, "lightning": blob}


def plain_loop_state() -> dict:
    return {"model": {"w": torch.zeros(10)}, "order": list(range(1_000_000)), "checkpointer": pickle.dumps({"a": 1})}


def one_run(chunks: int) -> dict[str, float]:
    data = manifest_bytes(chunks)
    meta = metadata_bytes(chunks)
    record = object_record()
    state = trainer_state(1_000)
    checks = SaveChecks(trust_option="x", pickled_sections={"lightning": safe_pickle.LIGHTNING_STATE_GLOBALS})
    plain = plain_loop_state()
    plain_checks = SaveChecks(trust_option="x", pickled_sections={"checkpointer": ()})
    allow_list_only = lambda: safe_pickle.RestrictedUnpickler(  # noqa: E731
        io.BytesIO(meta), safe_pickle.DCP_METADATA_GLOBALS, size=None
    ).load()
    return {
        "manifest_mb": len(data) / 1e6,
        "metadata_mb": len(meta) / 1e6,
        "manifest_bounded/json": best_of(lambda: bounded_json.loads(data, 1 << 30, schema_checked=("tensors",)))
        / best_of(lambda: json.loads(data)),
        "metadata_bounded/allow_list": best_of(lambda: safe_pickle.load_dcp_metadata(meta, "bench"))
        / best_of(allow_list_only),
        "metadata_bounded/pickle": best_of(lambda: safe_pickle.load_dcp_metadata(meta, "bench"))
        / best_of(lambda: pickle.loads(meta)),
        "record_bounded/weights_only": best_of(lambda: safe_pickle.load_torch_record(record), 20)
        / best_of(lambda: torch.load(io.BytesIO(record), weights_only=True), 20),
        "check_keys_ms": best_of(lambda: check_keys(state), 10) * 1e3,
        "save_checks_ms": best_of(lambda: checks(state, trust=False, rank=0), 10) * 1e3,
        "plain_save_checks_ms": best_of(lambda: plain_checks(plain, trust=False, rank=0)) * 1e3,
        "plain_torch_save_ms": best_of(lambda: torch.save(plain["order"], io.BytesIO())) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=200_000, help="chunks in the manifest and .metadata")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    runs = [one_run(args.chunks) for _ in range(args.runs)]
    for run in runs:
        print(json.dumps({key: round(value, 3) for key, value in run.items()}))
    print(f"{'measure':32} {'min':>8} {'median':>8} {'max':>8}")
    for key in runs[0]:
        column = [run[key] for run in runs]
        print(f"{key:32} {min(column):8.3f} {statistics.median(column):8.3f} {max(column):8.3f}")


if __name__ == "__main__":
    main()
