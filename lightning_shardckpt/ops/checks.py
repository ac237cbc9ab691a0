"""What `shardckpt bisect --bad CHECK` asks of one checkpoint: is it bad, and which part of it?

    nonfinite               any NaN/Inf in a model or optimizer tensor: a fresh scan, one global tensor at a time
    nonfinite:recorded      the same from the writer's per-tensor `finite` flags (no tensor read; a scan where unrecorded)
    verify                  every byte against its checksum (ops/verify.py)
    drill                   the newest recorded restore drill, or a fresh drill when none is recorded
    metric:NAME>VALUE       the outcome recorded at save time (`extra.metrics`); also <, >=, <=. NaN is bad
    module:function         the user's function of a CheckpointHandle, returning True (bad) / False,
                            or a CheckResult

A check is a callable `CheckpointHandle -> CheckResult`; `parse_check` builds one from the text.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..engine.catalog import CheckpointEntry
from ..engine.format import drill_records
from ..engine.format.names import join
from ..engine.format.outcomes import decode_metrics
from ..engine.load.global_tensors import GlobalTensorReader
from ..engine.storage.fsio import Location
from ..errors import ConfigError, CorruptCheckpoint
from ..policies.drills.runner import DrillOptions, run_drill
from ..policies.drills.worker import DrillFailed, load_callable
from .compare import nonfinite_count
from .verify import verify_checkpoint

NONFINITE, NONFINITE_RECORDED, VERIFY, DRILL, METRIC = "nonfinite", "nonfinite:recorded", "verify", "drill", "metric:"
NUMERIC = "numeric"  # a check about values: bisect ranks tensors by their change across the boundary
_METRIC = re.compile(r"^metric:(?P<name>.+?)(?P<op>>=|<=|>|<)(?P<value>[^<>=]+)$")
_OPERATORS = {">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le}


@dataclass
class CheckResult:
    """One checkpoint's verdict: `bad`, why (`summary`), and the affected tensors and files."""

    bad: bool
    summary: str = ""
    tensors: list[dict[str, Any]] = field(default_factory=list)  # {fqn, files, ...what the check saw}
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CheckpointHandle:
    """What a check receives: one committed checkpoint, its manifest, outcomes and tensors (read on demand)."""

    location: Location
    entry: CheckpointEntry

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def path(self) -> str:
        return join(self.location.url, self.entry.name)

    @property
    def step(self) -> int:
        return self.entry.step

    @property
    def manifest(self) -> dict[str, Any]:
        return self.entry.committed_manifest

    @property
    def metrics(self) -> dict[str, float]:
        """The scalar metrics the run had at save time ({} when none were recorded)."""
        return decode_metrics(self.manifest)

    def reader(self) -> GlobalTensorReader:
        """Global tensors one at a time, every byte checked: `with handle.reader() as r: r.read(fqn)`."""
        return GlobalTensorReader(self.location, self.entry)

    def tensor(self, fqn: str) -> torch.Tensor:
        with self.reader() as reader:
            return reader.read(fqn)


Check = Callable[[CheckpointHandle], CheckResult]


def parse_check(spec: str, *, storage_options: dict[str, Any] | None = None) -> tuple[Check, str]:
    """The check named by `spec` and its kind (numeric checks get a tensor ranking across the boundary)."""
    if spec == NONFINITE:
        return check_nonfinite, NUMERIC
    if spec == NONFINITE_RECORDED:
        return lambda handle: check_nonfinite(handle, recorded=True), NUMERIC
    if spec == VERIFY:
        return check_verify, VERIFY
    if spec == DRILL:
        return lambda handle: check_drill(handle, DrillOptions(storage_options=storage_options or {})), DRILL
    if spec.startswith(METRIC):
        match = _METRIC.match(spec)
        try:
            threshold = float(match["value"]) if match else math.nan
        except ValueError:
            threshold = math.nan
        if match is None or math.isnan(threshold):
            raise ConfigError(f"--bad {spec!r}: write metric:NAME>VALUE (or <, >=, <=), e.g. 'metric:train/loss>2.5'")
        return lambda handle: check_metric(handle, match["name"], match["op"], threshold), NUMERIC
    if ":" in spec:
        try:
            function = load_callable(spec)
        except (DrillFailed, ImportError) as err:
            raise ConfigError(
                f"--bad {spec!r}: cannot import the user check ({err}); it must be importable as module:function"
            ) from err
        return lambda handle: user_result(spec, function(handle)), NUMERIC
    raise ConfigError(
        f"--bad {spec!r} is not a check; use nonfinite, nonfinite:recorded, verify, drill, "
        "metric:NAME>VALUE or module:function"
    )


def check_nonfinite(handle: CheckpointHandle, *, recorded: bool = False) -> CheckResult:
    """Tensors with NaN/Inf. Streamed: one global tensor in memory at a time.

    `recorded=True` trusts the writer's `finite` flags where they exist and scans only unflagged tensors.
    """
    bad: list[dict[str, Any]] = []
    with handle.reader() as reader:
        for fqn, spec in reader.specs.items():
            if not (spec.dtype.is_floating_point or spec.dtype.is_complex):
                continue
            if recorded and spec.finite is not None:
                if not spec.finite:
                    bad.append({"fqn": fqn, "files": spec.files, "nonfinite": None, "numel": spec.numel})
                continue
            count = nonfinite_count(reader.read(fqn))
            if count:
                bad.append({"fqn": fqn, "files": spec.files, "nonfinite": count, "numel": spec.numel})
    files = sorted({name for item in bad for name in item["files"]})
    summary = f"{len(bad)} tensor(s) hold NaN/Inf" if bad else "every floating tensor is finite"
    return CheckResult(bool(bad), summary, bad, files)


def check_verify(handle: CheckpointHandle) -> CheckResult:
    report = verify_checkpoint(handle.location, handle.entry)
    tensors: dict[str, dict[str, Any]] = {}
    for problem in report.problems:
        if problem["tensor"]:
            item = tensors.setdefault(problem["tensor"], {"fqn": problem["tensor"], "files": [], "problems": []})
            item["files"] = sorted(set(item["files"]) | {problem["file"]})
            item["problems"].append(problem["kind"])
    files = sorted({problem["file"] for problem in report.problems})
    summary = (
        "every byte matches its checksum" if report.ok else f"{len(report.problems)} problem(s): {report.problems[0]}"
    )
    return CheckResult(not report.ok, summary, list(tensors.values()), files)


def check_drill(handle: CheckpointHandle, options: DrillOptions) -> CheckResult:
    """The newest drill record's verdict; a fresh drill (recorded, like any drill) when none says passed/failed."""
    records = drill_records.list_record_names(handle.location).get(handle.name, [])
    decided = [name for name in records if name.verdict in (drill_records.PASSED, drill_records.FAILED)]
    if decided:
        record = drill_records.read_record(handle.location, decided[-1]) or {"verdict": decided[-1].verdict}
        source = f"recorded drill {decided[-1].drill_id}"
    else:
        record = run_drill(handle.path, options)
        source = f"fresh drill {record.get('drill_id')}"
    bad = record.get("verdict") != drill_records.PASSED
    names = ((record.get("checks") or {}).get("nonfinite")) or []
    tensors = [{"fqn": name, "files": []} for name in names]
    summary = f"{source}: {record.get('verdict')}" + (f" ({record['cause']})" if record.get("cause") else "")
    return CheckResult(bad, summary, tensors, [])


def check_metric(handle: CheckpointHandle, name: str, op: str, threshold: float) -> CheckResult:
    metrics = handle.metrics
    if name not in metrics:
        raise ConfigError(
            f"{handle.name} recorded no metric {name!r} (recorded: {sorted(metrics) or 'none'}); "
            "metrics are recorded from trainer.callback_metrics by ShardedCheckpoint at save time"
        )
    value = metrics[name]
    bad = math.isnan(value) or _OPERATORS[op](value, threshold)  # a NaN loss is bad whatever the bound
    return CheckResult(bad, f"{name} = {value!r} ({'bad' if bad else 'good'}: bad means {op} {threshold!r} or NaN)")


def user_result(spec: str, value: Any) -> CheckResult:
    if isinstance(value, CheckResult):
        return value
    if isinstance(value, (bool, int)) or value is None:
        return CheckResult(bool(value), f"{spec} returned {value!r}")
    raise ConfigError(
        f"user check {spec} returned {type(value).__name__}; return True (bad), False (good) or a CheckResult"
    )


def safely(check: Check, handle: CheckpointHandle) -> CheckResult:
    """A checkpoint a check cannot read is bad: the damage is the finding (a bad chunk names its file)."""
    try:
        return check(handle)
    except CorruptCheckpoint as err:
        files = sorted({str(file) for problem in err.problems if (file := problem.get("file"))})
        tensors = [
            {"fqn": problem["tensor"], "files": [problem.get("file")]}
            for problem in err.problems
            if problem.get("tensor")
        ]
        return CheckResult(True, f"unreadable: {' '.join(str(err).split())}", tensors, files)
