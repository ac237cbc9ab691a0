"""The checkpoint engine: format, storage, commit protocol, staging, save and load.

Everything a checkpoint needs that is not about a training framework lives here: names on storage
(`layout`), the manifest, fsspec access with retries, DCP's storage writer/reader with checksums,
the commit protocol, staging buffers, the async saver and the loader, listing (`catalog`), run
ownership of a root and the per-attempt event log.

May import: torch, fsspec and the standard library, `..errors`, and its own modules. Never Lightning,
never `..identity`, `..lightning` or `..ops` (tests/unit/test_package_layout.py checks it), so the
same engine can serve Fabric or plain-torch callers.
"""
