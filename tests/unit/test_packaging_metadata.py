"""pyproject.toml's metadata builds without setuptools deprecation warnings (issue 9, item 13)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_license_is_an_spdx_string_that_setuptools_accepts_without_a_deprecation():
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(PYPROJECT))
    deprecations = [str(w.message).splitlines()[0] for w in caught if "Deprecat" in w.category.__name__]
    assert deprecations == [], f"setuptools {setuptools.__version__} warns: {deprecations}"
    assert getattr(dist.metadata, "license_expression", None) == "Apache-2.0"
