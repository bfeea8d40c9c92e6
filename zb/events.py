"""The metrics events, one record type each: what a line of `<log.dir>/metrics.jsonl` holds besides
`event`, `time` and `node` (zb.metrics writes those), and what the other backends and `zb status` get.

    emit(sink, Eval(step=10, outer_step=1, loss=2.5, perplexity=12.18))

Field names and values are an interface: users, scripts and `zb status` read them. Add a field, never
rename or drop one. Every field is on every line of its event, null when it has no value (a CPU's
`mfu`), except the fields made with `optional()`: those are absent from lines where they do not apply
(a blocking run's outer step has no `fragment`). Each field's comment documents it: docs/watching.md's table
in "Metrics and logs" is generated from these classes (`python -m zb.events --markdown`), and
tests/test_events.py fails when the two differ or a field has no comment.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from typing import Any, ClassVar, Protocol

_ABSENT_WITHOUT = "absent_without"   # field metadata: the field that must be set for this one to be on the line
_OFF_THE_LINE = "off_the_line"       # field metadata: kept for the loop, never written (a report's note)
_SPREAD = "spread"                   # field metadata: a nested record whose own fields go on the line in its place


def optional(*, alongside: str | None = None) -> Any:
    """A field absent from the line where it does not apply: when it is None, or, with `alongside`,
    when that other field is absent (figures that come together, such as a round's)."""
    return dataclasses.field(default=None, metadata={_ABSENT_WITHOUT: alongside or ""})


def off_the_line(default: Any) -> Any:
    """A field of a nested record that the loop reads but the line does not carry."""
    return dataclasses.field(default=default, metadata={_OFF_THE_LINE: True})


def spread() -> Any:
    """A nested record (OuterReport in OuterStep) whose fields are written in its place, flat."""
    return dataclasses.field(metadata={_SPREAD: True})


def line_fields(record: Any) -> dict[str, Any]:
    """A record's fields as the line carries them, in declaration order: nested records spread out,
    without the optional fields that do not apply and without the ones kept off the line."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.metadata.get(_OFF_THE_LINE):
            continue
        if f.metadata.get(_SPREAD):
            out.update(line_fields(value))
            continue
        if _ABSENT_WITHOUT in f.metadata:
            alongside = f.metadata[_ABSENT_WITHOUT]
            if (alongside and alongside not in out) or (not alongside and value is None):
                continue
        out[f.name] = value
    return out


def line_schema(cls: type) -> list[tuple[type, dataclasses.Field]]:
    """(the class that declares it, the field) for every field a line of `cls` can carry, nested records
    spread out: what docs/watching.md's table lists."""
    out: list[tuple[type, dataclasses.Field]] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get(_OFF_THE_LINE):
            continue
        if f.metadata.get(_SPREAD):
            out += line_schema(_nested_type(cls, f.name))
        else:
            out.append((cls, f))
    return out


def _nested_type(cls: type, name: str) -> type:
    nested = typing.get_type_hints(cls)[name]
    assert dataclasses.is_dataclass(nested) and isinstance(nested, type), f"{cls.__name__}.{name} is no record"
    return nested


class Sink(Protocol):
    """Anything metrics events go to: zb.metrics.MetricsSink, the status publisher's wrapper, a test's list."""

    def log(self, event: str, **fields: Any) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """The base of the records; EVENT is the line's `event` value."""

    EVENT: ClassVar[str]

    def fields(self) -> dict[str, Any]:
        """The line's fields (`line_fields`)."""
        return line_fields(self)


def emit(sink: Sink, record: Event) -> Any:
    """Write `record` to `sink` (its `log(event, **fields)`, which every sink has); returns what the sink does."""
    return sink.log(record.EVENT, **record.fields())


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunStart(Event):
    """A node starts: every run appended to one file begins with this line."""

    EVENT = "run_start"
    version: str                 # zb's version
    host: str                    # the machine's host name
    pid: int                     # the process id
    local_world_size: int        # the node's local ranks (1 for a stage worker)
    device: str                  # cuda or cpu
    settings: dict[str, Any]     # every config key not at zb's default, with its value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step(Event):
    """An inner step: every train.log_interval steps and the last (a first-stage worker: every step)."""

    EVENT = "step"
    step: int                    # inner steps taken by the run
    outer_step: int              # outer steps completed
    loss: float                  # mean cross-entropy over the node's batch (z-loss excluded)
    lr: float                    # the inner learning rate of the step
    grad_norm: float             # the gradient's norm before clipping
    z_loss: float | None         # the z-loss term (null for a stage worker)
    tokens: int                  # tokens this node trained on
    tokens_per_s: float          # this node's tokens per second over the step
    run_tokens: int              # tokens every node of the run trained on together
    run_tokens_per_s: float      # the run's tokens per second (this node's rate times the nodes)
    perplexity: float            # exp(loss)
    mfu: float | None            # model FLOPs utilization in percent (null without a peak: a CPU, a stage)
    stage: int | None = optional()           # a DiLoCo-SWARM worker: its stage
    micro_batches: int | None = optional()   # a DiLoCo-SWARM worker: micro-batches of the step


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eval(Event):
    """An evaluation on the held-out shard: every eval.interval steps and at the end."""

    EVENT = "eval"
    step: int                    # inner steps taken by the run
    outer_step: int              # outer steps completed
    loss: float                  # held-out mean cross-entropy
    perplexity: float            # exp(loss)


@dataclasses.dataclass(kw_only=True)
class OuterReport:
    """What one outer step did: what a DiLoCo node (zb.diloco.node) returns to the loop that ran it, and
    the part of the `outer_step` event that comes from it. A new field here is on the event's lines."""

    mesh_version: int            # the world this outer step ran in
    global_world_size: int       # nodes in that world
    num_peers: int               # nodes that contributed a pseudo-gradient
    attempts: int                # tries of the sync (a failed one is retried without the dead peer)
    allreduce_s: float = 0.0     # seconds of the all-reduce
    wire_bytes: int = 0          # bytes this node sent
    wire_mbps: float = 0.0       # Mbit/s of those bytes over the all-reduce
    applied: bool = False        # the average was applied (false: skipped, or the node received the state)
    hidden_s: float = 0.0        # diloco.overlap: all-reduce seconds that ran behind compute
    stall_s: float = 0.0         # seconds training waited for the all-reduce (blocking: all of it)
    d2h_s: float = 0.0           # blocking: seconds copying the pseudo-gradient to the host
    reduce_s: float = 0.0        # blocking: seconds reducing buckets (overlaps d2h_s inside allreduce_s)
    h2d_s: float = 0.0           # blocking: seconds copying the outer params back into the model
    resolve_s: float = 0.0       # seconds resolving the world (the store's roll call, waiting for every node)
    checkin_s: float = 0.0       # seconds of the check-in collective (waiting for the slowest node included)
    boundary_s: float = 0.0      # seconds of the whole outer step on this node; minus stall_s: what it cost besides the transfer
    params_hash: str | None = optional()     # train.log_model_hash: a digest of the params after the step
    fragment: int | None = optional()        # streaming: the fragment this outer step synced
    round_steps: dict[str, int] | None = optional()     # diloco.round_seconds: each node's inner steps in the round
    round_tokens: int | None = optional(alongside="round_steps")   # the run's tokens in the round
    round_weight: float | None = optional(alongside="round_steps")  # this node's weight in the average
    run_step: int | None = off_the_line(None)   # diloco.round_seconds: the run's step after the round (the loop moves there)
    clipped: list[str] | None = optional()   # diloco.clip: the nodes whose pseudo-gradients were scaled down
    discredited: list[str] | None = optional()   # the nodes whose claims did not hold besides the clipped: ahead of the run, non-finite, left out by the checked average
    evicted: list[str] | None = optional()   # diloco.evict_clipped: the nodes evicted at this outer step (discredited 3 in a row)
    note: str = off_the_line("")                # why nothing was applied, when that is expected (the log line's)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OuterStep(Event):
    """An outer step (DiLoCo): the node's OuterReport plus the loop's position and rates."""

    EVENT = "outer_step"
    outer_step: int              # outer steps completed, this one included
    step: int                    # inner steps taken by the run
    stage: int | None = optional()   # a DiLoCo-SWARM worker: its stage
    report: OuterReport = spread()   # what the node's outer step did: its fields, flat
    outer_tokens_per_s: float | None = optional()    # this node's tokens per second since the previous outer step
    outer_mfu: float | None = optional(alongside="outer_tokens_per_s")  # MFU at that rate (null without a peak)
    closing: bool | None = optional()        # the run's end under diloco.overlap: the last average applied
    run_tokens: int | None = optional(alongside="round_steps")     # the run's tokens after the round
    round_micro_batches: int | None = optional()     # a DiLoCo-SWARM worker: its micro-batches in the round


@dataclasses.dataclass(frozen=True, kw_only=True)
class Swarm(Event):
    """A DiLoCo-SWARM worker's pipeline: every train.log_interval steps and the last."""

    EVENT = "swarm"
    step: int                    # inner steps taken by the run
    outer_step: int | None = optional()      # a later stage: outer steps completed
    stage: int                   # the worker's stage
    micro_batches: int | None = optional()   # a later stage: micro-batches it stepped on
    forward: int                 # forward passes so far (a first stage: its micro-batches)
    backward: int                # backward passes so far, loss included (a first stage: its micro-batches)
    eval: int | None = optional()            # a later stage: evaluation requests served
    reissued: int | None = optional()        # a first stage: requests sent again to another worker so far
    not_ready: int               # "not ready" replies so far (the worker was at another step)
    shares: dict[str, dict[str, int]] | None = optional()   # a first stage: requests sent, per stage and worker
    throughput: dict[str, dict[str, float]] | None = optional()  # a first stage: measured rates, per stage and worker
    lr: float | None = optional()            # a later stage: the inner learning rate of the step
    grad_norm: float | None = optional()     # a later stage: the gradient's norm
    loss: float | None = optional(alongside="micro_batches")  # a later stage: mean loss it computed (null: none)
    pipeline_bytes_in: int       # bytes received from other stages
    pipeline_bytes_out: int      # bytes sent to other stages


@dataclasses.dataclass(frozen=True, kw_only=True)
class Membership(Event):
    """A new world: every change of membership is a new mesh version."""

    EVENT = "membership"
    mesh_version: int            # the world's version
    global_world_size: int       # nodes in it
    leader: str                  # the node that resolves the next round
    joined: list[str]            # nodes admitted (they receive the run's state)
    left: list[str]              # nodes that left with a goodbye
    died: list[str]              # nodes removed: silent, late or blamed
    global_rank: int             # this node's rank
    new_leader: bool             # the leader changed
    nodes: list[str]             # every node, by rank
    ring_mbps: float | None      # the ring's slowest hop when ranks follow measured links (else null)
    link_ms: float | None        # the longest one-way delay among the nodes' links, when all were timed (else null)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreFailover(Event):
    """The run's store stopped answering and this node moved to the next one of elastic.addr (zb.elastic.stores)."""

    EVENT = "store_failover"
    from_store: str              # the store that went silent (host:port)
    to_store: str                # the store the run re-formed on
    silent_s: float              # seconds the old store had not answered any of this node's clients when it moved
    failovers: int               # this node's moves so far
    mesh_version: int            # the world formed on the new store
    global_world_size: int       # nodes in it


@dataclasses.dataclass(frozen=True, kw_only=True)
class Checkpoint(Event):
    """A checkpoint written (or not: ok is false)."""

    EVENT = "checkpoint"
    step: int                    # the step it holds
    path: str | None             # where it was committed (null when it did not reach ckpt.path)
    blocking_s: float            # seconds training waited for it
    bytes: int                   # bytes written
    background_s: float          # seconds from its start until it was done in the background
    ok: bool                     # it reached ckpt.path
    final: bool                  # the run's last checkpoint


@dataclasses.dataclass(frozen=True, kw_only=True)
class Upload(Event):
    """A checkpoint's upload to ckpt.remote.path."""

    EVENT = "upload"
    step: int                    # the step of the checkpoint
    target: str                  # the URL of this rank's part
    seconds: float               # seconds it took, retries included
    bytes: int                   # bytes sent
    ok: bool                     # it arrived


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recovery(Event):
    """Live recovery: a joiner downloaded the run's outer state from live peers."""

    EVENT = "recovery"
    outer_step: int | None       # the outer step of the snapshot
    step: int                    # the step of the snapshot
    peers: list[str]             # the peers that served bytes
    bytes: int                   # bytes downloaded (files reused from an earlier try not counted)
    seconds: float               # seconds the download took


@dataclasses.dataclass(frozen=True, kw_only=True)
class Refused(Event):
    """The run refused this node (its settings differ from the run's, say): it exits 2."""

    EVENT = "refused"
    reason: str                  # the run's answer


RECORDS: tuple[type[Event], ...] = (RunStart, Step, Eval, OuterStep, Membership, StoreFailover, Checkpoint, Upload, Recovery,
                                    Swarm, Refused)


def field_docs(cls: type) -> dict[str, str]:
    """{field: its comment} from the class's source (a field without a comment is left out)."""
    source = inspect.getsource(cls)
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            comment = comments.get(node.end_lineno or node.lineno)
            if comment:
                docs[node.target.id] = comment
    return docs


def _when(f: dataclasses.Field) -> str:
    if _ABSENT_WITHOUT not in f.metadata:
        return ""
    alongside = f.metadata[_ABSENT_WITHOUT]
    return f" *(with `{alongside}`)*" if alongside else " *(optional)*"


def markdown() -> str:
    """docs/watching.md's table of every event and field."""
    lines = ["| event | field | meaning |", "|---|---|---|"]
    for cls in RECORDS:
        lines.append(f"| `{cls.EVENT}` | | {(cls.__doc__ or '').strip()} |")
        lines += [f"| | `{f.name}` | {field_docs(owner).get(f.name, '')}{_when(f)} |" for owner, f in line_schema(cls)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m zb.events --markdown   (docs/watching.md's table of metrics events)")
    sys.stdout.write(markdown())
