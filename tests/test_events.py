"""The metrics events as records (zb.events): the table in docs/watching.md is generated from them, every field is
documented, `emit` writes the line metrics.jsonl always had, and the ledger both training loops share
(zb.train.ledger) moves the run position and builds the events as the loops did by hand before."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from zb import events
from zb.events import Eval, Event, OuterReport, OuterStep, Step, Swarm, emit
from zb.metrics import MetricsSink, read_metrics
from zb.position import RunPosition

WATCHING = Path(__file__).resolve().parents[1] / "docs" / "watching.md"


class ListSink:
    def __init__(self) -> None:
        self.lines: list[dict] = []

    def log(self, event: str, **fields) -> dict:
        self.lines.append({"event": event, **fields})
        return self.lines[-1]


def _docs_table() -> str:
    text = WATCHING.read_text()
    start = text.index("| event | field | meaning |\n")
    return text[start:text.index("\n\n", start) + 1]


def test_the_docs_table_is_the_generated_one():
    assert _docs_table() == events.markdown(), \
        "docs/watching.md's metrics table is stale: replace it with the output of `python -m zb.events --markdown`"


def test_every_record_and_field_is_documented():
    def subclasses(cls):
        return {c for s in cls.__subclasses__() for c in {s} | subclasses(s)}

    assert set(events.RECORDS) == subclasses(Event), "a record missing from RECORDS is missing from docs/watching.md"
    assert len({r.EVENT for r in events.RECORDS}) == len(events.RECORDS)
    for record in events.RECORDS:
        assert (record.__doc__ or "").strip(), record.__name__
        missing = [f.name for owner, f in events.line_schema(record) if not events.field_docs(owner).get(f.name)]
        assert missing == [], f"{record.__name__}: fields without a comment: {missing}"


def test_emit_writes_event_time_node_then_the_fields(tmp_path):
    sink = MetricsSink(tmp_path, "node-a")
    emit(sink, Eval(step=10, outer_step=1, loss=math.inf, perplexity=math.inf))
    emit(sink, Step(step=10, outer_step=1, loss=2.0, lr=1e-3, grad_norm=0.5, z_loss=None, tokens=640,
                    tokens_per_s=100.0, run_tokens=1280, run_tokens_per_s=200.0, perplexity=math.exp(2.0), mfu=None))
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert list(first)[:3] == ["event", "time", "node"] and isinstance(first["time"], float)
    assert first == {"event": "eval", "time": first["time"], "node": "node-a", "step": 10, "outer_step": 1,
                     "loss": "inf", "perplexity": "inf"}   # JSON has no Inf: written as a string, as always
    step = read_metrics(tmp_path / "metrics.jsonl", "step")[0]
    # Fields without a value are null (z_loss, mfu); optional ones that do not apply are absent (stage).
    assert step["z_loss"] is None and step["mfu"] is None and "stage" not in step and "micro_batches" not in step


def _report(**overrides) -> OuterReport:
    values = dict(mesh_version=3, global_world_size=2, num_peers=2, attempts=1, allreduce_s=0.5, wire_bytes=100,
                  wire_mbps=1.6, applied=True)
    values.update(overrides)
    return OuterReport(**values)


def test_optional_fields_are_absent_where_they_do_not_apply():
    base = dict(outer_step=1, step=4, report=_report(note=" | a note", run_step=9))
    blocking = OuterStep(**base).fields()
    assert list(blocking)[:4] == ["outer_step", "step", "mesh_version", "global_world_size"]   # the report, flat
    assert "note" not in blocking and "run_step" not in blocking       # the loop's, not the line's
    assert not {"params_hash", "fragment", "round_steps", "round_tokens", "stage", "closing"} & set(blocking)
    rates = OuterStep(**base, outer_tokens_per_s=10.0, outer_mfu=None).fields()
    assert rates["outer_mfu"] is None   # it comes with the rate, null without a peak
    adaptive = OuterStep(report=_report(round_steps={"a": 3}, round_tokens=96, round_weight=0.5),
                         outer_step=1, step=4, run_tokens=200).fields()
    assert adaptive["run_tokens"] == 200 and adaptive["round_tokens"] == 96
    assert "run_tokens" not in OuterStep(**base, run_tokens=200).fields()   # only with the round's figures
    later = Swarm(step=1, stage=1, micro_batches=2, forward=2, backward=2, eval=0, not_ready=0, lr=1e-3,
                  grad_norm=0.1, loss=None, pipeline_bytes_in=1, pipeline_bytes_out=2).fields()
    assert later["loss"] is None and "reissued" not in later and "shares" not in later


# -- the ledger ---------------------------------------------------------------------------------------
def _ledger(**kwargs):
    import torch

    from zb.train.ledger import Ledger

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    sink = ListSink()
    return Ledger(sink, scheduler, **kwargs), sink, optimizer


def test_the_ledger_moves_the_position_and_the_lr_schedule_with_it():
    ledger, _, optimizer = _ledger(tokens_per_step=64)
    ledger.nodes = 3
    assert ledger.inner_step() == RunPosition(1, 0, 64, 192)
    ledger.move_to(RunPosition(10, 2, 9999, 1000))   # a joiner keeps its own tokens
    assert ledger.position == RunPosition(10, 2, 64, 1000) and optimizer.param_groups[0]["lr"] == pytest.approx(1 / 11)
    ledger.move_to(RunPosition(20, 4, 640, 2000), own_tokens=True)   # a resume takes them back
    assert ledger.position == RunPosition(20, 4, 640, 2000)


def test_the_outer_step_event_of_the_training_loop():
    ledger, sink, _ = _ledger(tokens_per_step=64, mfu=lambda rate: None)
    ledger.start_round()
    ledger.inner_step()
    record = ledger.outer_step(_report(params_hash="ab"))
    assert ledger.nodes == 2 and ledger.position == RunPosition(1, 1, 64, 64)
    line = sink.lines[-1]
    assert line == {"event": "outer_step", **record.fields()}
    assert list(line)[1:3] == ["outer_step", "step"] and line["outer_step"] == 1 and line["step"] == 1
    assert line["params_hash"] == "ab" and line["outer_tokens_per_s"] > 0 and line["outer_mfu"] is None
    assert not {"stage", "fragment", "closing", "run_tokens", "round_micro_batches"} & set(line)
    ledger.outer_step(_report(), closing=True)
    assert sink.lines[-1]["closing"] is True and sink.lines[-1]["outer_step"] == 2


def test_an_adaptive_round_moves_every_node_to_the_runs_step_and_tokens():
    ledger, sink, _ = _ledger(tokens_per_step=64, mfu=lambda rate: 1.0)
    ledger.move_to(RunPosition(10, 2, 640, 1000), own_tokens=True)
    ledger.start_round()
    for _ in range(3):
        ledger.inner_step()
    ledger.outer_step(_report(run_step=14, round_steps={"a": 3, "b": 5}, round_tokens=512, round_weight=0.375))
    assert ledger.position == RunPosition(14, 3, 832, 1512) and ledger.round_start == ledger.position
    assert sink.lines[-1]["run_tokens"] == 1512 and sink.lines[-1]["round_tokens"] == 512


def test_a_stage_workers_events_carry_its_stage_and_no_rates():
    ledger, sink, _ = _ledger(tokens_per_step=0, stage=1)
    ledger.move_to(RunPosition(4, 1, 0, 0))
    ledger.outer_step(_report(), received=RunPosition(8, 2, 5, 300), round_micro_batches=7)
    line = sink.lines[-1]
    assert (line["outer_step"], line["step"], line["stage"], line["round_micro_batches"]) == (3, 8, 1, 7)
    assert "outer_tokens_per_s" not in line and "outer_mfu" not in line
    assert ledger.position == RunPosition(8, 3, 0, 300)


def test_step_and_eval_events_and_the_step_line():
    ledger, sink, _ = _ledger(tokens_per_step=100, mfu=lambda rate: round(rate / 1000, 3))
    ledger.nodes = 2
    ledger.inner_step()
    record = ledger.step(loss=800.0, lr=1e-3, grad_norm=0.5, z_loss=0.1, seconds=0.3)
    assert sink.lines[-1] == {"event": "step", "step": 1, "outer_step": 0, "loss": 800.0, "lr": 1e-3,
                              "grad_norm": 0.5, "z_loss": 0.1, "tokens": 100, "tokens_per_s": 333.3,
                              "run_tokens": 200, "run_tokens_per_s": 666.7, "perplexity": math.inf, "mfu": 0.333}
    line = ledger.step_line(record, 10, seconds=0.3, eta_s=2.7)
    assert line.startswith("step 1/10 | loss 800.0000") and "tok/s 333 | run tok/s 667 | run tokens 200" in line
    assert ledger.eval(2.0).perplexity == pytest.approx(math.exp(2.0))
    stage, sink, _ = _ledger(tokens_per_step=100, stage=0)
    stage.inner_step()
    stage.step(loss=2.0, lr=1e-3, grad_norm=0.5, z_loss=None, seconds=1.0, micro_batches=2)
    assert sink.lines[-1]["stage"] == 0 and sink.lines[-1]["micro_batches"] == 2 and sink.lines[-1]["mfu"] is None


# -- what the consumers read ----------------------------------------------------------------------------
def _fields(event: str) -> set[str]:
    record = next(r for r in events.RECORDS if event == r.EVENT)
    return {f.name for _, f in events.line_schema(record)}


def test_the_status_record_and_the_backends_read_fields_the_events_have():
    from zb.monitor.scalars import PRIME_NAMES
    from zb.status.record import KEPT

    for event, names in [*KEPT.items(), *((e, tuple(n)) for e, n in PRIME_NAMES.items())]:
        assert set(names) <= _fields(event), event


def test_a_recovery_result_is_the_recovery_event():
    from zb.ckpt.recovery.fetch import FetchResult

    result = FetchResult(Path("/x"), 40, 4, ["a:1"], 1000, 1.23456, {"a:1": 1000})
    sink = ListSink()
    emit(sink, result.record())
    assert sink.lines == [{"event": "recovery", "outer_step": 4, "step": 40, "peers": ["a:1"], "bytes": 1000,
                           "seconds": 1.235}]
