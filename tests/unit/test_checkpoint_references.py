"""One parser for every spelling of a checkpoint (engine/root.parse_reference), shared by the three front
doors and the command line."""

import pytest

from lightning_shardckpt.engine.root import parse_reference


@pytest.mark.parametrize(
    ("text", "selector"),
    [
        ("latest", "latest"),
        ("last-good", "last-good"),
        ("500", 500),
        (500, 500),
        ("step-500", 500),
        ("0a1b2c3d4e5f", "0a1b2c3d4e5f"),
        ("step-000000500-0a1b2c3d4e5f", "step-000000500-0a1b2c3d4e5f"),
    ],
)
def test_selectors_name_a_checkpoint_within_a_known_root(text, selector):
    reference = parse_reference(text)
    assert reference.selector == selector and not reference.is_path


@pytest.mark.parametrize(
    "text",
    [
        "/data/ckpt/run-7",
        "s3://bucket/run-7",
        "./500",  # a directory here whose name looks like a step
        "ckpt",  # a relative root
        "/data/ckpt/run-7/step-000000500-0a1b2c3d4e5f",
        "0A1B2C3D4E5F",  # ids are lowercase hex: this is a name, so a path
        "step-",
    ],
)
def test_anything_else_is_a_path(text):
    reference = parse_reference(text)
    assert reference.is_path and reference.text == text


def test_only_latest_may_answer_an_empty_root_with_nothing():
    assert parse_reference("latest").newest
    assert not parse_reference("last-good").newest and not parse_reference(3).newest
