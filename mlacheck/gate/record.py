"""The record of one gate run (or baseline) of a task: frozen dataclasses with JSON load/save.

A record holds, per document, whether the filters of the task's two scoring roles
(strict-match, flexible-extract; see :mod:`mlacheck.gate.task`) scored the answer correct,
what they extracted, and whether the output was invalid (no answer) or degenerate
(repetition loop); the aggregate accuracies with their standard errors; whether the run
completed; and free-form configuration metadata (model, server arguments, KV dtype,
attention backend, versions, date). Baselines are records with a ``provenance`` note.
A record names its task in its schema, ``mlacheck.gate.<task>/1``, so that it can be read
without the task being registered.

A record may be *aggregate-only* (no samples: e.g. a baseline taken from a published
lm-eval results file); compare then falls back to unpaired statistics.

On disk: one JSON object; the samples list has one sample per line so that baselines
committed to git diff readably.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mlacheck.gate.errors import GateError
from mlacheck.gate.task import FLEXIBLE, ROLES, STRICT, TASK_NAME_RE, GateTask
from mlacheck.gate.tasks import DEFAULT_TASK, get_task

_SCHEMA_PREFIX, _SCHEMA_SUFFIX = "mlacheck.gate.", "/1"


def schema_of(task: str) -> str:
    """The schema string of a task's records; it names the task so that a record of one task
    is never read as another's."""
    return f"{_SCHEMA_PREFIX}{task}{_SCHEMA_SUFFIX}"


# The schema of records that name no task (the default task's).
SCHEMA = schema_of(DEFAULT_TASK)

STATUS_COMPLETE = "complete"
STATUS_ABORTED = "aborted"
STATUSES = (STATUS_COMPLETE, STATUS_ABORTED)

SCORED_BY_LMEVAL = "lm-eval"
SCORED_BY_MIRROR = "mlacheck-mirror"  # partial records: see mlacheck.gate.task


@dataclass(frozen=True)
class SampleRecord:
    """Outcome of one document."""

    doc_id: int
    doc_hash: str  # mlacheck.gate.task.doc_hash(question)
    target: str  # the gold answer (GateTask.gold_of: for GSM8K the final number)
    strict_correct: bool
    flexible_correct: bool
    strict_answer: str  # what the strict-match filter extracted ("[invalid]" if nothing)
    flexible_answer: str
    no_number: bool  # the flexible-extract filter found no answer (named for GSM8K's numbers)
    degenerate: bool  # repetition loop (mlacheck.gate.task.is_degenerate)

    @property
    def invalid(self) -> bool:
        return self.no_number or self.degenerate

    def correct(self, metric: str) -> bool:
        if metric == STRICT:
            return self.strict_correct
        if metric == FLEXIBLE:
            return self.flexible_correct
        raise GateError(f"unknown metric {metric!r}; expected one of {', '.join(ROLES)}")


@dataclass(frozen=True)
class MetricSummary:
    """Aggregate accuracy of one filter."""

    accuracy: float
    stderr: float | None
    n: int

    @property
    def successes(self) -> int:
        return round(self.accuracy * self.n)


@dataclass(frozen=True)
class RunMetadata:
    """How the run was made. Free-form fields are whatever the user passed."""

    model: str
    backend: str  # "local-completions", "in-process:<LM class>", "lm-eval-results", ...
    base_url: str | None = None
    server_args: str | None = None
    kv_dtype: str | None = None
    attention_backend: str | None = None
    num_fewshot: int | None = None
    limit: int | None = None
    max_gen_toks: int | None = None
    data_source: str | None = None
    protocol_sha256: str | None = None  # mlacheck.gate.task.protocol_sha256
    versions: Mapping[str, str] = field(default_factory=dict)
    date: str | None = None  # ISO 8601, UTC
    extra: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Provenance:
    """Why a record became a baseline."""

    name: str
    promoted_by: str
    promoted_at: str  # ISO 8601, UTC
    reason: str
    source: str  # path of the run record that was promoted


@dataclass(frozen=True)
class GateRecord:
    metadata: RunMetadata
    metrics: Mapping[str, MetricSummary]  # keyed by role (STRICT, FLEXIBLE)
    n_planned: int  # documents lm-eval was asked to evaluate
    samples: tuple[SampleRecord, ...] = ()
    status: str = STATUS_COMPLETE
    error: str | None = None
    failed_requests: int = 0  # requests left without a response when the run aborted
    scored_by: str = SCORED_BY_LMEVAL
    provenance: Provenance | None = None
    task: str = DEFAULT_TASK  # name of the gate task that was run

    @property
    def has_samples(self) -> bool:
        return bool(self.samples)

    @property
    def complete(self) -> bool:
        return self.status == STATUS_COMPLETE and self.failed_requests == 0

    def metric(self, name: str) -> MetricSummary:
        try:
            return self.metrics[name]
        except KeyError:
            raise GateError(
                f"record has no {name!r} metric (has: {', '.join(self.metrics) or 'none'})"
            ) from None

    def invalid_count(self) -> int:
        return sum(s.invalid for s in self.samples)

    def with_provenance(self, provenance: Provenance) -> GateRecord:
        return replace(self, provenance=provenance)

    # --- JSON -------------------------------------------------------------------------

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "schema": schema_of(self.task),
            "status": self.status,
            "error": self.error,
            "n_planned": self.n_planned,
            "failed_requests": self.failed_requests,
            "scored_by": self.scored_by,
            "metrics": {k: asdict(v) for k, v in self.metrics.items()},
            "metadata": _metadata_to_dict(self.metadata),
            "provenance": asdict(self.provenance) if self.provenance else None,
            "samples": [asdict(s) for s in self.samples],
        }

    def dumps(self) -> str:
        """JSON text: pretty header, one sample per line."""
        data = self.to_json_dict()
        samples = data.pop("samples")
        head = json.dumps(data, indent=2, ensure_ascii=False)
        if not samples:
            body = '  "samples": []'
        else:
            rows = ",\n".join("    " + json.dumps(s, ensure_ascii=False) for s in samples)
            body = '  "samples": [\n' + rows + "\n  ]"
        return head[:-2] + ",\n" + body + "\n}\n"

    def save(self, path: Path) -> None:
        """Write atomically (a reader never sees half a record)."""
        write_text_atomic(path, self.dumps())

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> GateRecord:
        schema = str(data.get("schema"))
        task = schema.removeprefix(_SCHEMA_PREFIX).removesuffix(_SCHEMA_SUFFIX)
        if schema != schema_of(task) or not TASK_NAME_RE.match(task):
            raise GateError(
                f"unsupported schema {data.get('schema')!r} (expected 'mlacheck.gate.<task>/1')"
            )
        status = data["status"]
        if status not in STATUSES:
            raise GateError(f"unknown status {status!r}")
        metrics = {k: _metric_from_dict(v) for k, v in data["metrics"].items()}
        unknown = set(metrics) - set(ROLES)
        if unknown:
            raise GateError(f"unknown metrics {sorted(unknown)}")
        samples = tuple(_sample_from_dict(s) for s in data.get("samples", []))
        ids = [s.doc_id for s in samples]
        if len(set(ids)) != len(ids):
            raise GateError("duplicate doc_id in samples")
        prov = data.get("provenance")
        return cls(
            metadata=_metadata_from_dict(data["metadata"]),
            metrics=metrics,
            n_planned=int(data["n_planned"]),
            samples=samples,
            status=status,
            error=data.get("error"),
            failed_requests=int(data.get("failed_requests", 0)),
            scored_by=str(data.get("scored_by", SCORED_BY_LMEVAL)),
            provenance=Provenance(**prov) if prov else None,
            task=task,
        )

    @classmethod
    def load(cls, path: Path) -> GateRecord:
        """Load a record; any problem becomes a one-line GateError naming the file."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise GateError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise GateError(f"{path}: cannot read JSON: {exc}") from None
        if not isinstance(data, dict):
            raise GateError(f"{path}: not a gate record (top level is not an object)")
        try:
            return cls.from_json_dict(data)
        except GateError as exc:
            raise GateError(f"{path}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise GateError(
                f"{path}: not a valid gate record ({type(exc).__name__}: {exc})"
            ) from None


def _metadata_to_dict(meta: RunMetadata) -> dict[str, Any]:
    out = asdict(meta)
    out["versions"] = dict(meta.versions)
    out["extra"] = dict(meta.extra)
    return out


def _metadata_from_dict(data: Mapping[str, Any]) -> RunMetadata:
    known = {f for f in RunMetadata.__dataclass_fields__}
    unknown = set(data) - known
    if unknown:
        raise GateError(f"unknown metadata fields {sorted(unknown)}")
    fields = dict(data)
    fields["versions"] = {str(k): str(v) for k, v in dict(data.get("versions") or {}).items()}
    fields["extra"] = {str(k): str(v) for k, v in dict(data.get("extra") or {}).items()}
    return RunMetadata(**fields)


def _metric_from_dict(data: Mapping[str, Any]) -> MetricSummary:
    acc = float(data["accuracy"])
    n = int(data["n"])
    if not 0.0 <= acc <= 1.0 or n < 0:
        raise GateError(f"bad metric summary {dict(data)}")
    stderr = data.get("stderr")
    return MetricSummary(acc, None if stderr is None else float(stderr), n)


def _sample_from_dict(data: Mapping[str, Any]) -> SampleRecord:
    return SampleRecord(
        doc_id=int(data["doc_id"]),
        doc_hash=str(data["doc_hash"]),
        target=str(data["target"]),
        strict_correct=bool(data["strict_correct"]),
        flexible_correct=bool(data["flexible_correct"]),
        strict_answer=str(data["strict_answer"]),
        flexible_answer=str(data["flexible_answer"]),
        no_number=bool(data["no_number"]),
        degenerate=bool(data["degenerate"]),
    )


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def metrics_from_samples(samples: tuple[SampleRecord, ...]) -> dict[str, MetricSummary]:
    """Aggregate accuracies (lm-eval's mean and standard error) from per-sample outcomes."""
    from mlacheck.gate.stats import mean_stderr

    n = len(samples)
    out: dict[str, MetricSummary] = {}
    for name in ROLES:
        k = sum(s.correct(name) for s in samples)
        out[name] = MetricSummary(k / n if n else 0.0, mean_stderr(k, n), n)
    return out


def lmeval_role_metrics(
    task: GateTask, results: Mapping[str, Any], n: int
) -> dict[str, MetricSummary]:
    """Role metrics from lm-eval's results entry of ``task`` (``exact_match,<filter>`` and
    its stderr, which lm-eval writes as "N/A" when it has none)."""
    out = {}
    for role in ROLES:
        name = task.role_filters[role]
        se = results.get(f"exact_match_stderr,{name}")
        stderr = float(se) if isinstance(se, (int, float)) else None
        out[role] = MetricSummary(float(results[f"exact_match,{name}"]), stderr, n)
    return out


def record_from_lmeval_results(
    data: Mapping[str, Any], source: str, task: GateTask | None = None
) -> GateRecord:
    """An aggregate-only record of ``task`` (default: the default task) from an lm-eval
    results JSON (``results_*.json``) that contains it. Used to promote published/old results
    as unpaired baselines."""
    task = task or get_task(DEFAULT_TASK)
    try:
        n = int(data["n-samples"][task.name]["effective"])
        metrics = lmeval_role_metrics(task, data["results"][task.name], n)
    except (KeyError, TypeError, ValueError) as exc:
        raise GateError(
            f"{source}: not an lm-eval results file with a {task.name!r} task ({exc!r})"
        ) from None
    config = data.get("config") or {}
    model_args = config.get("model_args")
    versions = {"lm_eval": str(data["lm_eval_version"])} if "lm_eval_version" in data else {}
    shots = (data.get("n-shot") or {}).get(task.name)
    return GateRecord(
        metadata=RunMetadata(
            model=str(model_args if model_args else config.get("model", "unknown")),
            backend="lm-eval-results",
            num_fewshot=int(shots) if shots is not None else None,
            data_source=source,
            versions=versions,
        ),
        metrics=metrics,
        n_planned=n,
        task=task.name,
    )
