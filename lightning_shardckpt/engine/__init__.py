"""The checkpoint engine: everything a checkpoint needs that is not about a training framework.

Sub-rooms: `format/` (names on storage, manifest and its schema, checksums, safe unpickling,
references, drill records, the listed-checkpoint entry), `storage/` (fsspec locations and one backend
class per kind of storage, bounded retries, DCP's StorageWriter/StorageReader with checksums, chunk
reads), `save/` (staging, persist, the commit point, incremental saves, the async saver), `load/` (the
loader, global tensors), `tiers/` (tier options, verified copies, replication, which tier a resume
reads). Top level: listing a root (`catalog`), configs, the per-attempt event log (`metrics`),
collectives, run ownership of a root, state-tree helpers.

May import: torch, fsspec and the standard library, `..errors`, and its own modules; never a room
above it (identity, policies, training, ops, lightning, cli) and never Lightning
(tests/unit/test_package_layout.py checks it), so the same engine serves Fabric or plain-torch callers.
"""
