"""Relations between config keys (one key's range is declared on its knob, see zb.config.CHECKS):
impossible combinations exit 2 with one line naming the key and its source; odd but workable ones
are warned about.

Pure: it yields what is wrong and zb.config raises, so this module needs only the schema. Checks
that need more than the config (the local rank count, the model size table) run where that
knowledge lives (zb.train.setup) with zb.config.fail.
"""

from __future__ import annotations

from collections.abc import Iterator

from zb.addresses import parse_stores
from zb.config_schema import Config, DilocoConfig
from zb.model_sizes import model_names
from zb.overlap_modes import mode_of, unused_fragment_keys
from zb.sparse_scheme import SparseScheme


def advisories(cfg: Config) -> Iterator[tuple[str, str]]:
    """(key, why it is probably not what was meant) for settings that work but look mistaken: warned, not refused
    (Prime ran them, and a Prime file must load)."""
    if cfg.optim.warmup_steps > cfg.optim.total_steps:
        yield "optim.warmup_steps", f"is longer than optim.total_steps ({cfg.optim.total_steps}): the LR never reaches optim.lr"
    if cfg.optim.sched_type == "wsd-sqrt" and cfg.optim.stable_steps is not None and \
            cfg.optim.stable_steps >= cfg.optim.total_steps:
        yield "optim.stable_steps", f"is not below optim.total_steps ({cfg.optim.total_steps}): the LR never decays"
    if cfg.data.fake and cfg.data.dataset_ratio is not None:
        yield "data.dataset_ratio", "has no effect with data.fake (random tokens)"
    if cfg.diloco is not None:
        yield from unused_fragment_keys(mode_of(cfg.diloco.overlap), cfg.diloco, DilocoConfig())
    if cfg.diloco is not None and cfg.diloco.round_seconds is not None and \
            cfg.diloco.inner_steps != DilocoConfig().inner_steps:
        yield "diloco.inner_steps", "has no effect with diloco.round_seconds (each round trains the steps that fit)"
    if cfg.diloco is not None:
        yield from mode_of(cfg.diloco.overlap).advisories(cfg.diloco)
    if cfg.diloco is not None and cfg.diloco.compression != "sparse":
        default = DilocoConfig()
        for key in ("sparse_chunk", "sparse_k", "sparse_beta", "sparse_average"):
            if getattr(cfg.diloco, key) != getattr(default, key):
                yield f"diloco.{key}", "has no effect without diloco.compression = sparse"
    if cfg.diloco is not None and cfg.diloco.error_feedback and cfg.diloco.compression == "none":
        yield "diloco.error_feedback", "has no effect with diloco.compression = none (nothing is dropped)"
    if cfg.elastic.link_probe_seconds != 2.0 and not cfg.elastic.measure_links:
        yield "elastic.link_probe_seconds", "has no effect without elastic.measure_links"
    if cfg.elastic.store_failover_s != 30.0 and _stores(cfg) < 2:
        yield "elastic.store_failover_s", "has no effect with one store in elastic.addr (nothing to fail over to)"
    if cfg.diloco is not None and mode_of(cfg.diloco.overlap).in_flight and cfg.diloco.round_seconds is None and \
            cfg.optim.total_steps % cfg.diloco.inner_steps:
        yield "optim.total_steps", (f"is not a multiple of diloco.inner_steps ({cfg.diloco.inner_steps}): with "
                                    "diloco.overlap the run ends on the shared params, so the inner steps after the "
                                    "last outer step are dropped from the final model")


def _stores(cfg: Config) -> int:
    """How many stores elastic.addr names (its range check has already parsed it)."""
    return len(parse_stores(cfg.elastic.addr, cfg.elastic.port)) if cfg.elastic.addr else 1


def problems(cfg: Config) -> Iterator[tuple[str, str]]:
    """(key, what is wrong) for every relation between keys that does not hold."""
    if cfg.diloco is not None and cfg.diloco.clip is not None:
        if cfg.diloco.clip < 1:
            yield "diloco.clip", "must be at least 1 (the median contribution itself is never scaled)"
        if mode_of(cfg.diloco.overlap).in_flight:
            yield "diloco.clip", (f"cannot combine with diloco.overlap = {cfg.diloco.overlap} yet: the norms are "
                                  "compared in the check-in, which an overlapped all-reduce has already left behind")
    if cfg.diloco is not None and cfg.diloco.evict_clipped and cfg.diloco.clip is None:
        yield "diloco.evict_clipped", ("needs diloco.clip: it evicts the nodes diloco.clip scaled down in 3 outer steps "
                                       "in a row (set diloco.clip K, e.g. 1)")
    if _stores(cfg) > 1 and cfg.swarm is not None:
        yield "elastic.addr", ("names several stores, but a DiLoCo-SWARM run does not fail over yet (its stages' "
                               "routing lives on one store): name one store")
    if _stores(cfg) > 1 and cfg.elastic.store_failover_s <= cfg.elastic.heartbeat_interval:
        yield "elastic.store_failover_s", (f"must exceed elastic.heartbeat_interval ({cfg.elastic.heartbeat_interval}): "
                                           "a store is judged silent by the heartbeats it missed")
    if cfg.model.name not in model_names(cfg.model.type):
        yield "model.name", f"no such {cfg.model.type} size; valid names: {', '.join(model_names(cfg.model.type))}"
    if cfg.optim.batch_size % cfg.train.micro_bs:
        yield "optim.batch_size", f"must be a multiple of train.micro_bs ({cfg.train.micro_bs})"
    if cfg.elastic.heartbeat_timeout <= cfg.elastic.heartbeat_interval:
        yield "elastic.heartbeat_timeout", f"must exceed elastic.heartbeat_interval ({cfg.elastic.heartbeat_interval})"
    rank, size = cfg.data.data_rank, cfg.data.data_world_size
    if rank is not None and size is not None and rank >= size:
        yield "data.data_rank", f"must be below data.data_world_size ({size})"
    if cfg.data.fake and cfg.data.dataset_name_or_paths != "builtin":
        yield "data.fake", "conflicts with data.dataset_name_or_paths; choose one source"
    if cfg.data.dataset_ratio is not None:
        yield from _ratio_problems(cfg)
    if cfg.ckpt.interval is not None and cfg.ckpt.path is None and not cfg.ckpt.live_recovery:
        yield "ckpt.interval", "is set but ckpt.path is not; say where checkpoints go"
    if cfg.ckpt.resume == "latest" and cfg.ckpt.path is None and not cfg.ckpt.live_recovery:
        yield "ckpt.resume", "latest is looked for under ckpt.path, which is not set; set ckpt.path to where the " \
                             "checkpoints are (--ckpt.path DIR), or name a step directory"
    if cfg.ckpt.remote.path is not None and cfg.ckpt.path is None:
        yield "ckpt.remote.path", "needs ckpt.path (remote copies are made from the local checkpoint)"
    adaptive = cfg.diloco is not None and cfg.diloco.round_seconds is not None
    if cfg.diloco is not None and not adaptive and cfg.ckpt.interval is not None and \
            cfg.ckpt.interval % cfg.diloco.inner_steps:
        yield "ckpt.interval", f"must be a multiple of diloco.inner_steps ({cfg.diloco.inner_steps})"
    if cfg.diloco is not None:
        yield from mode_of(cfg.diloco.overlap).problems(cfg.diloco, adaptive)
    if cfg.diloco is not None and cfg.diloco.compression == "sparse":
        yield from _sparse_problems(cfg.diloco)
    if cfg.diloco is not None and cfg.diloco.reduce_shape == "halving" and cfg.diloco.compression in ("none", "sparse"):
        yield "diloco.reduce_shape", (f"halving applies to int8, int4 and int2 only: with diloco.compression = "
                                      f"{cfg.diloco.compression} the exchange is "
                                      f"{'gloo' if cfg.diloco.compression == 'none' else 'the sparse gather'}'s own; "
                                      "leave it auto or ring")
    if cfg.eval.only and not cfg.ckpt.resume:
        yield "eval.only", "evaluates a checkpoint: name it with ckpt.resume (latest with ckpt.path, a step directory " \
                           "or a remote URL of one)"
    if cfg.eval.only and cfg.swarm is not None:
        yield "eval.only", "a DiLoCo-SWARM stage holds part of the model and cannot evaluate alone; evaluate an " \
                           "exported model instead (zb export)"
    if cfg.swarm is not None:
        yield from _swarm_problems(cfg)


def _sparse_problems(d: DilocoConfig) -> Iterator[tuple[str, str]]:
    wrong = SparseScheme(d.sparse_chunk, d.sparse_k).problem()
    if wrong is not None:
        yield f"diloco.sparse_{wrong[0]}", f"is wrong: {wrong[1]}"
    if not 0.0 <= d.sparse_beta < 1.0:
        yield "diloco.sparse_beta", (f"{d.sparse_beta:g} is outside [0, 1): the accumulator's decay (zb's default "
                                     "is 0.8, SparseLoCo's 0.95)")
    if d.error_feedback is False:
        yield "diloco.error_feedback", ("cannot be off with diloco.compression = sparse: what a chunk does not send "
                                        "waits in the accumulator (without it 98% of every pseudo-gradient is lost)")
    if d.sparse_average == "senders" and d.clip is not None:
        yield "diloco.sparse_average", ("senders cannot combine with diloco.clip yet: the checked average splits the "
                                        "sum into parts that add up, and a mean over each entry's senders does not; "
                                        "set diloco.sparse_average = nodes")
    if d.overlap == "eager":
        yield "diloco.compression", ("sparse cannot combine with diloco.overlap = eager yet: eager stands in this node's "
                                     "dense pseudo-gradient for its share of the average in flight, while the average "
                                     "holds its sparse accumulator, so the correction would not cancel; use streaming")


def _swarm_problems(cfg: Config) -> Iterator[tuple[str, str]]:
    """DiLoCo-SWARM: the stage's workers sync by blocking DiLoCo; a worker is one process."""
    sw = cfg.swarm
    assert sw is not None  # called only with a [swarm] table
    if sw.stages < 2:
        yield "swarm.stages", "must be at least 2 (one stage is plain DiLoCo: drop the [swarm] table)"
    if sw.stage is not None and sw.stage >= sw.stages:
        yield "swarm.stage", f"must be below swarm.stages ({sw.stages}); stages count from 0"
    if sw.split is not None:
        parts = [p.strip() for p in sw.split.split(",")]
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            yield "swarm.split", "must list a positive block count per stage, comma separated (\"3,1\")"
        elif len(parts) != sw.stages:
            yield "swarm.split", f"names {len(parts)} stages but swarm.stages is {sw.stages}"
    if cfg.diloco is None:
        yield "swarm.stages", ("needs a [diloco] table: the workers of a stage sync by DiLoCo (set diloco.inner_steps, "
                               "1 syncs every step)")
    elif mode_of(cfg.diloco.overlap).in_flight or cfg.diloco.round_seconds is not None:
        yield "swarm.stages", "needs diloco.overlap = none and no diloco.round_seconds (a stage syncs at fixed steps)"


def dataset_entries(spec: str) -> list[str]:
    """The comma-separated entries of data.dataset_name_or_paths."""
    return [e.strip() for e in spec.split(",") if e.strip()]


def ratio_weights(ratio: str) -> list[float]:
    """data.dataset_ratio as numbers ("55:10:35" -> [55.0, 10.0, 35.0]); ValueError says what is wrong."""
    weights = []
    for part in ratio.split(":"):
        try:
            weight = float(part)
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a number") from None
        if not 0 < weight < float("inf"):
            raise ValueError(f"weight {part.strip()} is not a positive number")
        weights.append(weight)
    return weights


def _ratio_problems(cfg: Config) -> Iterator[tuple[str, str]]:
    if cfg.data.fake:
        return  # an advisory: the ratio has nothing to mix
    try:
        assert cfg.data.dataset_ratio is not None  # called only when it is set
        weights = ratio_weights(cfg.data.dataset_ratio)
    except ValueError as e:
        yield "data.dataset_ratio", f"{e}; write one positive weight per source, colon separated (\"55:10:35\")"
        return
    sources = len(dataset_entries(cfg.data.dataset_name_or_paths))
    if len(weights) != sources:
        yield "data.dataset_ratio", (f"has {len(weights)} weights but data.dataset_name_or_paths names {sources} "
                                     "sources (comma separated); give one weight per source")
