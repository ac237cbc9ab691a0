"""One storage backend per kind of storage, chosen once when a location is resolved (engine/storage/backends.py)."""

from __future__ import annotations

import uuid

import pytest

from lightning_shardckpt.engine.storage import backends
from lightning_shardckpt.engine.storage.fsio import Location, resolve


def test_a_local_path_resolves_to_the_local_backend_with_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    location = resolve("ckpt")
    assert type(location.backend) is backends.LocalBackend
    assert location.is_local and location.backend.has_directories
    assert location.path == str(tmp_path / "ckpt")


def test_memory_resolves_to_the_memory_backend_whose_create_refuses_a_second_writer():
    location = resolve(f"memory://backends-{uuid.uuid4().hex}")
    assert type(location.backend) is backends.MemoryBackend
    path = f"{location.path}/manifest.json"
    location.backend.create_if_absent(path, b"first")
    with pytest.raises(FileExistsError):
        location.backend.create_if_absent(path, b"second")
    assert location.fs.cat_file(path) == b"first"


def test_s3_resolves_to_the_s3_backend_without_directories_or_cached_listings(s3_root):
    location = resolve(s3_root.url, {**s3_root.storage_options, "use_listings_cache": True})
    assert type(location.backend) is backends.S3Backend
    assert not location.is_local and not location.backend.has_directories
    # a cached listing would hide other processes' commits: the option is overridden before the filesystem opens
    assert backends.S3Backend.options_for(s3_root.url, {"use_listings_cache": True})["use_listings_cache"] is False
    location.backend.makedirs(f"{location.path}/never-created")  # keys need no parent: nothing is written
    assert not location.fs.exists(f"{location.path}/never-created")


def test_a_location_built_by_hand_gets_its_backend_from_its_filesystem(tmp_path):
    resolved = resolve(str(tmp_path))
    by_hand = Location(fs=resolved.fs, path=str(tmp_path / "sub"), url=str(tmp_path / "sub"))
    assert type(by_hand.backend) is backends.LocalBackend
    assert not by_hand.same_place(resolved)
    assert Location(fs=resolved.fs, path=resolved.path, url="elsewhere").same_place(resolved)


def test_local_and_memory_roots_are_never_the_same_place(tmp_path):
    local = resolve(str(tmp_path))
    memory = resolve(f"memory://{tmp_path}")
    assert memory.path.rstrip("/").endswith(local.path.rstrip("/").lstrip("/"))
    assert not local.same_place(memory)
