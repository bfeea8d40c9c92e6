"""The config tree: one dataclass per subsystem, a docstring under every field.

Each subsystem receives only its own section. Key names follow Prime (ZeroBand) where Prime had
the key, so Prime users feel at home. The loader (zb.config) turns TOML files, env twins and
--section.key flags into this tree and validates it; `knob()` carries what the loader and --help
need: the doc line, allowed values, value aliases and, for Prime-compatible keys, the env name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from zb.overlap_modes import MODES


def knob(default: Any, doc: str, *, choices: tuple = (), aliases: dict | None = None, env: str | None = None,
         check: str | None = None, run_defining: bool = False, items: tuple = ()) -> Any:
    """A config field. `aliases` maps accepted spellings to canonical values (Prime's "uint8" -> "int8");
    `env` overrides the ZB_<SECTION>_<KEY> twin; `check` names the value's range (zb.config.CHECKS),
    applied wherever the value comes from; `run_defining` marks the keys every node of a run must
    share (the run fingerprint): all others may differ per node. `items` makes a str knob a list:
    a TOML array or a comma-separated string of these words, kept as "a,b" (no repeats)."""
    meta = {"doc": doc, "choices": choices, "aliases": aliases or {}, "env": env, "check": check,
            "run_defining": run_defining, "items": items}
    return field(default=default, metadata=meta)


def section(cls: type, doc: str) -> Any:
    return field(default_factory=cls, metadata={"doc": doc, "section": True})


# The defaults are the built-in run of `zb train` with no arguments: the debug model on the
# offline text, a couple of minutes on 2 CPU cores. Real runs set their values in configs/.


@dataclass
class ModelConfig:
    name: str = knob("debug", "Model size from the family's size table: Prime's names and shapes (llama2: debugmodel, 70M, "
                     "150M, 271M, 1B, 7B, 10B, 13B, 26B, 70B; llama3: debugmodel, 1B, 8B, 10B, 70B, 405B) and "
                     "zb's CPU sizes debug and tiny in both.", run_defining=True)
    type: str = knob("llama2", "Model family: llama2 (MHA-style defaults) or llama3 (GQA, larger RoPE theta).",
                     choices=("llama2", "llama3"), run_defining=True)
    dim: Optional[int] = knob(None, "Override the hidden size of the named size.", check="positive", run_defining=True)
    n_layers: Optional[int] = knob(None, "Override the number of transformer blocks.", check="positive", run_defining=True)
    n_heads: Optional[int] = knob(None, "Override the number of attention heads.", check="positive", run_defining=True)
    n_kv_heads: Optional[int] = knob(None, "Override the number of key/value heads (grouped-query attention).", check="positive", run_defining=True)
    vocab_size: Optional[int] = knob(None, "Override the vocabulary size (default: the tokenizer's, rounded up).", check="positive", run_defining=True)
    rope_theta: Optional[float] = knob(None, "Override the RoPE base frequency.", check="positive", run_defining=True)
    attn_impl: str = knob("auto", "Attention kernel: auto (flash-attn on CUDA when installed, else SDPA), sdpa, flash.",
                          choices=("auto", "sdpa", "flash"))


@dataclass
class TrainConfig:
    micro_bs: int = knob(8, "Micro batch size per local rank (sequences per forward pass).", check="positive")
    seed: int = knob(1337, "Seed for model init and data order; every node must use the same one.", check="non_negative", run_defining=True)
    device: str = knob("auto", "auto (CUDA + NCCL when available, else MPS on an Apple-silicon Mac with one local "
                               "rank, else CPU + gloo), cpu, cuda or mps.", choices=("auto", "cpu", "cuda", "mps"))
    param_dtype: str = knob("auto", "FSDP2 compute dtype of params: auto (bf16 on CUDA, fp32 on CPU and MPS), fp32, bf16 (MPS: macOS 14+).",
                            choices=("auto", "fp32", "bf16"))
    reduce_dtype: str = knob("fp32", "FSDP2 gradient reduction dtype: fp32, bf16, or param (the params' compute dtype, "
                                     "Prime's reduce_fp32 = false).", choices=("fp32", "bf16", "param"))
    ac_ckpt: int = knob(0, "Activation checkpointing (less memory, more compute): true or 1 for every transformer "
                           "block, N for every Nth block (0, 1 of N blocks), false or 0 for none.",
                        aliases={"true": 1, "false": 0}, check="non_negative")
    reshard_after_forward: bool = knob(True, "FSDP2: free gathered params after forward (less memory).")
    reduce_every_micro_batch: bool = knob(False, "FSDP2: reduce-scatter gradients after every micro batch, so only "
                                                 "sharded gradients accumulate (far less memory, more local traffic).")
    torch_compile: bool = knob(False, "torch.compile each block (GPU runs; slow to start on CPU).")
    fused_linear_ce: bool = knob(False, "Compute the output projection and the loss a chunk of tokens at a time, "
                                        "recomputing each chunk's logits in backward: the [tokens, vocab] logits "
                                        "are never held whole (far less memory at large vocabularies).")
    fsdp_cpu_offload: bool = knob(False, "FSDP2 CPU offload: params, gradients and optimizer state live in host memory "
                                         "(CUDA runs: fits larger models, slower steps).")
    log_model_hash: bool = knob(False, "Log a hash of the (outer) params, so agreement between nodes can be checked.")
    log_interval: int = knob(10, "Log a step line and a `step` metrics event every N steps.", check="positive")
    max_steps: Optional[int] = knob(None, "Stop after this many steps (default: optim.total_steps).", check="positive")
    peak_tflops: Optional[float] = knob(None, "Peak dense TFLOPS of one device, for the mfu metric (default: a table of "
                                              "common GPUs at bf16; none for CPUs, whose mfu is then not reported).",
                                        check="positive")


@dataclass
class OptimConfig:
    lr: float = knob(3e-3, "Peak learning rate of the inner AdamW.", check="positive")
    weight_decay: float = knob(0.1, "AdamW weight decay.", check="non_negative")
    adam_betas1: float = knob(0.9, "AdamW beta1.", check="fraction")
    adam_betas2: float = knob(0.95, "AdamW beta2.", check="fraction")
    eps: float = knob(1e-8, "AdamW epsilon.", check="non_negative")
    warmup_steps: int = knob(20, "Linear warmup steps.", check="non_negative")
    total_steps: int = knob(200, "Length of the LR schedule in steps; also the default run length.", check="positive")
    sched_type: str = knob("cosine", "LR schedule after warmup: cosine, linear, wsd (warmup-stable-decay, linear "
                                     "decay) or wsd-sqrt (Prime's: 1 - sqrt decay from optim.stable_steps).",
                           choices=("cosine", "linear", "wsd", "wsd-sqrt"))
    stable_steps: Optional[int] = knob(None, "wsd-sqrt: the step at which the decay starts, counted from step 0 with "
                                             "the warmup (default: where wsd's decay_ratio puts it).", check="positive")
    min_lr_ratio: float = knob(0.1, "Final LR as a fraction of optim.lr.", check="fraction")
    decay_ratio: float = knob(0.2, "wsd only: fraction of total_steps spent decaying at the end.", check="fraction")
    batch_size: int = knob(16, "Sequences per optimizer step per node (per DiLoCo worker), over all local ranks.", check="positive")
    grad_clip: float = knob(1.0, "Clip the global grad norm to this value (0 disables).", check="non_negative")
    z_loss: bool = knob(False, "Add max-z-loss (weight z_loss_weight) to keep logits bounded.")
    z_loss_weight: float = knob(2e-4, "Weight of the max-z-loss.", check="non_negative")
    num_chunks: Optional[int] = knob(None, "Compute the loss over this many chunks of the tokens (default: one, or 8 "
                                           "with train.fused_linear_ce); fp32 logits exist one chunk at a time.",
                                     check="positive")


@dataclass
class DataConfig:
    seq_length: int = knob(128, "Tokens per training sequence.", check="seq_length", run_defining=True)
    fake: bool = knob(False, "Random tokens, for throughput measurements (nothing to learn).")
    dataset_name_or_paths: str = knob("builtin", "Where text comes from: builtin (offline generated text), "
                                      "local files, directories or globs (.txt, .jsonl, .parquet), or a Hugging "
                                      "Face dataset name (owner/name, or owner/name:config). Comma separated: "
                                      "with dataset_ratio, each entry is a source of the mixture; without it, "
                                      "local paths only, read as one source (their files in sorted order).")
    dataset_config: Optional[str] = knob(None, "Hugging Face dataset config (subset) name, for every hub source "
                                               "that does not name its own with name:config.")
    dataset_ratio: Optional[str] = knob(None, "Mix the comma-separated sources of dataset_name_or_paths: colon-"
                                              "separated sampling weights, one per source (\"55:10:35\"). Each "
                                              "document is drawn from a source with these odds (seeded, resumes "
                                              "exactly); a source that runs out starts over while the others go on.")
    split_by_data_rank: bool = knob(True, "Split every source between data ranks. false: the files were split per "
                                          "node beforehand, so each node reads its sources whole (split only over "
                                          "its local ranks).")
    reverse_data_files: bool = knob(False, "Read each source's data files in reverse order (before they are dealt "
                                           "to data ranks).")
    document_mask: bool = knob(True, "Attention stays inside each document packed into a sequence (block-"
                                     "diagonal causal mask; flash-attn varlen on GPU), as Prime's sequence_packing. "
                                     "false: tokens attend across document boundaries. Fake data has no documents.")
    split: str = knob("train", "Dataset split to read.")
    text_column: str = knob("text", "Column holding the text in jsonl/parquet/HF sources.")
    tokenizer: str = knob("auto", "Tokenizer: bytes (built in, 256 + specials), a Hugging Face tokenizer name or path, "
                                  "or auto: bytes for the builtin or fake data, else Prime's choice per model.type "
                                  "(llama2: mistralai/Mistral-7B-v0.1, llama3: meta-llama/Meta-Llama-3-8B).",
                          run_defining=True)
    data_rank: Optional[int] = knob(None, "This node's data shard (default: its global rank).", check="non_negative")
    data_world_size: Optional[int] = knob(None, "Number of data shards (default: the global world size).", check="positive")
    streaming: bool = knob(True, "Stream Hugging Face datasets instead of downloading them whole.")
    shuffle_buffer: int = knob(0, "Streaming shuffle buffer in documents (0: keep file order, exact resume).", check="non_negative")
    eval_fraction: float = knob(0.01, "Fraction of documents held out for evaluation (disjoint from training).", check="fraction")
    retries: int = knob(5, "Retries, with exponential backoff, on transient HTTP errors from the hub (datasets "
                           "and tokenizers).", check="non_negative")
    cache_budget_gb: float = knob(100.0, "Disk budget per node, in GB, for the files of a streamed Hugging Face "
                                         "dataset: beyond it, files already read and behind the latest checkpoint "
                                         "are deleted from the cache, oldest first.", check="positive")
    prefetch: int = knob(2, "Training batches made ahead in a background thread (0: inline). On by default on CUDA "
                            "only: on the CPU the thread competes with the step for cores and the GIL, so it "
                            "applies there only when set.", check="non_negative")


@dataclass
class EvalConfig:
    interval: int = knob(50, "Evaluate the held-out split every N steps (0: only at the end; -1: never).", check="interval")
    batches: int = knob(8, "Micro batches per evaluation.", check="positive")
    only: bool = knob(False, "Evaluate the checkpoint ckpt.resume names on eval.batches held-out micro batches per "
                             "rank, print the loss and exit: no training, nothing written, no other node contacted.")


LOG_LEVELS = ("NOTSET", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass
class LogConfig:
    dir: str = knob("logs", "Directory for metrics.jsonl (one per node: give each node its own).")
    progress: str = knob("auto", "Progress display: auto (rich on a terminal, log lines otherwise), rich, plain.",
                         choices=("auto", "rich", "plain"))
    level: str = knob("INFO", "Log level of zb's lines (-v and -q override it).", choices=LOG_LEVELS,
                      aliases={**{name.lower(): name for name in LOG_LEVELS}, "true": "DEBUG", "1": "DEBUG"})
    all_ranks: bool = knob(False, "Info lines from every local rank, not only local rank 0.", env="ZB_LOG_ALL_RANKS")
    backends: str = knob("jsonl", "Where metrics go (each node's local rank 0 writes them), a list: jsonl "
                                  "(<log.dir>/metrics.jsonl), wandb (Weights & Biases), tensorboard (event files "
                                  "in <log.dir>/tensorboard); wandb and tensorboard need pip install 'zb[monitor]'.",
                         items=("jsonl", "wandb", "tensorboard"))
    wandb_project: str = knob("zb", "Weights & Biases project (Prime's project).")
    wandb_name: Optional[str] = knob(None, "Weights & Biases run name (Prime's run_name; default: the node id). Each "
                                           "node logs its own wandb run.")
    wandb_group: Optional[str] = knob(None, "Weights & Biases group: give every node of a DiLoCo run the same one to "
                                            "see their runs together.")
    wandb_id: Optional[str] = knob(None, "Weights & Biases run id (Prime's run_id; default: a new one). Under DiLoCo "
                                         "each node's run is <wandb_id>-<node id>.")
    wandb_resume: bool = knob(False, "Continue the wandb run of the same wandb_id (without one: this machine's last "
                                     "run, as Prime's wandb_resume) instead of starting a new one.")
    wandb_mode: str = knob("auto", "auto (the WANDB_MODE variable, else online), online, or offline (no network: "
                                   "the run is kept in <log.dir>/wandb; upload it later with `wandb sync`).",
                           choices=("auto", "online", "offline"))


# diloco.outer_lr's default with diloco.compression = sparse, by diloco.sparse_average (BENCHMARKS.md, "Sparse
# pseudo-gradients"): the mean over every node divides an entry one node sent by the node count
SPARSE_OUTER_LR = {"senders": 2.5, "nodes": 4.0}


@dataclass
class DilocoConfig:
    inner_steps: int = knob(100, "H: inner steps between two outer syncs.", check="positive", run_defining=True)
    round_seconds: Optional[float] = knob(None, "Speed-adaptive rounds: a wall-clock budget per round instead of "
                                          "diloco.inner_steps; each node trains the steps that fit (timed from the end "
                                          "of the last outer step) and the average weighs nodes by their tokens. "
                                          "Under diloco.overlap = streaming the round's diloco.fragments boundaries "
                                          "share it equally.", check="positive", run_defining=True)
    outer_lr: Optional[float] = knob(None, "Outer learning rate. Default: 0.7; with diloco.compression = sparse 4 "
                                           "(diloco.sparse_average = nodes) or 2.5 (senders), the best measured for each "
                                           "on the convergence benchmark (BENCHMARKS.md, \"Sparse pseudo-gradients\").",
                                     check="positive", run_defining=True)
    outer_momentum: Optional[float] = knob(None, "Outer optimizer momentum. Default: 0.9, or 0 with diloco.compression = "
                                           "sparse (SparseLoCo's outer step: the error-feedback accumulator, decayed by "
                                           "diloco.sparse_beta, takes momentum's place).", check="non_negative",
                                           run_defining=True)
    nesterov: bool = knob(True, "Nesterov momentum for the outer SGD.", run_defining=True)
    outer_optimizer: str = knob("sgd", "Outer optimizer: sgd (with momentum/nesterov) or avg (plain averaging).",
                                choices=("sgd", "avg"), run_defining=True)
    compression: str = knob("none", "Pseudo-gradient all-reduce: none (fp32), int8, int4 or int2 (4x, 7.5x or 15x "
                                    "fewer bytes on the wire; blockwise scales, the same bits on every node), or sparse "
                                    "(SparseLoCo: the diloco.sparse_k largest of every diloco.sparse_chunk values of the "
                                    "error-feedback accumulator at 2 bits, 195x fewer bytes a payload at the defaults, "
                                    "gathered by every node: docs/slow-links.md says when to pick it).",
                            choices=("none", "int8", "int4", "int2", "sparse"), aliases={"no": "none", "uint8": "int8"},
                            run_defining=True)
    reduce_shape: str = knob("auto", "Message pattern of the int8/int4/int2 all-reduce: ring (2 (N - 1) steps "
                                     "a sync), halving (recursive halving-doubling: 2 log2 N steps, plus 2 when N is "
                                     "no power of two), or auto: halving at 4, 8, 16 ... nodes; at other counts "
                                     "halving where the links' measured delay makes it faster, the ring otherwise "
                                     "(docs/slow-links.md).", choices=("auto", "ring", "halving"),
                             run_defining=True)
    sparse_chunk: int = knob(4096, "Sparse: values per chunk, a power of two from 16 to 65536 (an index packs "
                                   "log2(chunk) bits).", check="positive", run_defining=True)
    sparse_k: int = knob(64, "Sparse: entries sent per chunk, a multiple of 8 up to diloco.sparse_chunk.",
                         check="positive", run_defining=True)
    sparse_beta: float = knob(0.8, "Sparse: decay of the error-feedback accumulator at every outer step "
                                   "(e <- beta e + pseudo-gradient), in [0, 1). 0.8 trained best of 0.7 to 0.95 on "
                                   "the convergence benchmark; SparseLoCo's is 0.95.", run_defining=True)
    sparse_average: str = knob("nodes", "Sparse: each entry of the update averaged over every contributing node, as "
                                        "SparseLoCo (nodes: an entry one node sent moves by its value over the node "
                                        "count, which a larger outer lr makes up for), or over the nodes that sent it "
                                        "(senders: by that node's value). On the convergence benchmark senders took "
                                        "0.15M params from +24% to fp32's loss, and both were within 1% of fp32 at "
                                        "1.87M, nodes the better (docs/slow-links.md). senders cannot combine with "
                                        "diloco.clip yet.",
                               choices=("nodes", "senders"), run_defining=True)
    error_feedback: Optional[bool] = knob(None, "Keep what quantization dropped from this node's pseudo-gradient and "
                                                "send it at the next outer step (8 bytes per parameter on the host). "
                                                "Default: on for int4, int2 and sparse (which needs it), off for int8.")
    stripes: Optional[int] = knob(None, "Stripes of the outer state: local rank r < stripes of every node holds stripe r "
                                        "of every parameter's rows and all-reduces it over replica group r, so nodes of "
                                        "different local rank counts train one run. Every node needs at least this many "
                                        "local ranks (a node with more moves rows inside itself). Default: the first "
                                        "node's local rank count; a joiner takes the run's.", check="positive")
    streams: int = knob(1, "Parallel process groups (TCP connections) per replica group for the all-reduce.", check="positive")
    retry_all_reduce: int = knob(3, "Retries of a failed pseudo-gradient sync, each without the failed peers.", check="non_negative")
    bucket_mb: float = knob(64.0, "Pseudo-gradient bucket size in MB (transfer of one overlaps copy of the next).", check="positive")
    min_bandwidth_mbps: float = knob(10.0, "Slowest link expected (Mbit/s); bounds each transfer's deadline.", check="positive")
    blocking_join: bool = knob(True, "Joiners fetch state from a live node before the step they join (else live recovery).")
    overlap: str = knob("none", "Overlap the outer all-reduce with inner steps: none (blocking outer step), eager (the "
                        "all-reduce runs behind the next round; its average is applied one round later with the eager "
                        "correction, arXiv 2502.12996), streaming (diloco.fragments synced in turn, each all-reduce "
                        "behind diloco.fragment_delay inner steps, arXiv 2501.18512) or delayed (the naive one-round "
                        "delay: the average applied one round later, nothing local; a baseline).",
                        choices=tuple(MODES), run_defining=True)
    fragments: int = knob(1, "Streaming: P, fragments synced in turn (transformer blocks strided over them); "
                             "diloco.inner_steps must be a multiple of P (rounds of fixed steps).", check="positive", run_defining=True)
    fragment_delay: int = knob(1, "Streaming: tau, inner steps a fragment's all-reduce overlaps (below inner_steps / "
                                  "fragments; with diloco.round_seconds the launch comes when a boundary's share of "
                                  "the budget ends within tau steps; 0 syncs each fragment blocking).", check="non_negative", run_defining=True)
    fragment_alpha: float = knob(0.5, "Streaming: alpha, merge of a synced fragment: local * alpha + outer * (1 - alpha).",
                                 run_defining=True)
    clip: Optional[float] = knob(None, "Robust aggregation (blocking DiLoCo): a contributor whose pseudo-gradient norm "
                                 "exceeds this many times the round's median norm is scaled down to that bound before "
                                 "the average (the same decision on every node, logged with both norms); the average is "
                                 "checked against the stated norms (a contribution larger than its node said, or "
                                 "non-finite, is left out), and a round's token count is bounded the same way (pick it at "
                                 "least the ratio of your fastest node's tokens to the median's); at least 1; alone or true: 1, the measured choice (docs/security.md). Unset: averaged "
                                 "as they are. Every node of a run must share it.", aliases={"true": 1.0},
                                 run_defining=True)
    evict_clipped: bool = knob(False, "With diloco.clip: evict a node discredited in 3 outer steps in a row "
                               "(clipped over 2x the median, ahead of the run, non-finite, or left out by the checked "
                               "average; the same decision on every node): its updates count for nothing from the next outer step, the "
                               "leader leaves it out of the world and never admits its id again, and the node itself "
                               "exits 2. Every node of a run must share it.", run_defining=True)
    drift_guard: bool = knob(True, "Compare a digest of the outer params at every check-in; a node that differs from the "
                             "majority receives the run's state instead of contributing (costs one sha256 of the shard per outer step).")

    def lr(self) -> float:
        """diloco.outer_lr as it applies (its default depends on diloco.compression)."""
        if self.outer_lr is not None:
            return self.outer_lr
        return SPARSE_OUTER_LR[self.sparse_average] if self.compression == "sparse" else 0.7

    def momentum(self) -> float:
        """diloco.outer_momentum as it applies (its default depends on diloco.compression)."""
        if self.outer_momentum is not None:
            return self.outer_momentum
        return 0.0 if self.compression == "sparse" else 0.9


@dataclass
class RemoteConfig:
    path: Optional[str] = knob(None, "Remote checkpoint location (fsspec URL: s3://, gs://, or a local directory).")
    interval: Optional[int] = knob(None, "Upload every N steps (default: every checkpoint).", check="positive")


@dataclass
class CkptConfig:
    interval: Optional[int] = knob(None, "Checkpoint every N steps (a multiple of diloco.inner_steps under DiLoCo; with "
                                         "diloco.round_seconds at the first outer step at or past each multiple).",
                                   check="positive")
    path: Optional[str] = knob(None, "Directory for durable checkpoints on this node's disk.")
    remote: RemoteConfig = section(RemoteConfig, "Remote copies of checkpoints.")
    topk: int = knob(3, "Keep only the newest K complete checkpoints of the running branch (on ckpt.path and the "
                        "remote copy; an older one goes only once a newer one is complete; the newest step of a branch "
                        "a resume left is kept); 0 keeps every one.", check="non_negative")
    resume: Optional[str] = knob(None, "Resume from `latest` (the newest complete step of the current branch, on "
                                       "disk or on the remote copy), a step directory, or a remote URL of one.")
    ram_dir: str = knob("/dev/shm/zb", "RAM-backed staging directory for snapshots.")
    live_recovery: bool = knob(False, "Keep a RAM snapshot after every outer step and serve it to joiners.")
    skip_dataloader: bool = knob(False, "On resume, restore model and optimizer state but start the data from the "
                                        "beginning of this node's shard (e.g. after changing the data).")
    grace_period: float = knob(30.0, "Seconds allowed for the final checkpoint after SIGTERM.", check="non_negative")


@dataclass
class ElasticConfig:
    addr: Optional[str] = knob(None, "Address of the global store (`zb store`), or several in failover order: "
                               "host[:port],host[:port] (the run moves to the next when the current one is silent "
                               "for elastic.store_failover_s).", env="GLOBAL_ADDR", check="store_list")
    port: int = knob(29600, "Port of the global store (of each elastic.addr entry without one).", env="GLOBAL_PORT",
                     check="port")
    unique_id: Optional[str] = knob(None, "This node's unique id (generated if absent).", env="GLOBAL_UNIQUE_ID", check="node_id")
    world_size: int = knob(1, "Initial quorum: nodes the first outer step waits for (up to start_timeout).",
                           env="GLOBAL_WORLD_SIZE", check="positive")
    rank: int = knob(0, "Preferred starting global rank.", env="GLOBAL_RANK", check="non_negative")
    host_store: bool = knob(False, "This node hosts the store itself (Prime style; a single point of failure).")
    store_timeout: float = knob(300.0, "Seconds before a global store operation times out; also the most a joiner waits for admission.",
                                env="ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS", check="positive")
    polling_interval: float = knob(0.1, "Seconds between polls of the store while waiting (a roll call also wakes at once on its next answer or world).",
                                   env="ZERO_BAND_GLOBAL_STORE_POLLING_INTERVAL_SECONDS", check="positive")
    heartbeat_interval: float = knob(2.0, "Seconds between heartbeats; also the grace a peer blamed for a failed collective has to check in.",
                                     env="ZERO_BAND_EDM_HEARTBEAT_INTERVAL_SECONDS", check="positive")
    heartbeat_timeout: float = knob(10.0, "Seconds without a heartbeat change (on the observer's own clock) after which a node is dead.",
                                    env="ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS", check="positive")
    pg_timeout: float = knob(60.0, "Timeout of the global gloo groups: building them, and collectives without a tighter deadline of their own.",
                             env="ZERO_BAND_GLOBAL_PG_TIMEOUT_SECONDS", check="positive")
    store_failover_s: float = knob(30.0, "Seconds the current store may be silent before the run moves to the next "
                                   "store of elastic.addr (nodes wait for it at the outer step that finds it silent).",
                                   check="positive")
    connect_timeout: float = knob(30.0, "Seconds to keep trying to reach the store at start; also the most its "
                                        "handshake may take (something that listens there but is not a zb store is "
                                        "one error after it).", check="positive")
    start_timeout: float = knob(60.0, "Seconds the first outer step waits for the initial quorum.", check="positive")
    sync_deadline: float = knob(60.0, "Seconds a node may be late for the check-in at an outer step before it is dropped (it rejoins later).", check="positive")
    peer_filter: bool = knob(True, "gloo's listener admits only the world's members' gloo addresses (a kernel socket "
                             "filter set before each world's groups are built), so a connection flood from any other "
                             "host cannot exhaust this node's file descriptors. Off where members connect from another "
                             "address than the one they publish (NAT between nodes, several interfaces without "
                             "GLOO_SOCKET_IFNAME). Linux only.")
    link_matrix: Optional[str] = knob(None, "A `zb iperf-mesh --json` file: order the ring by its measured links (maximize "
                                      "the slowest hop). Its rows are matched to nodes by id (iperf-mesh --node-id) or "
                                      "gloo address; a file without this node is an error.")
    measure_links: bool = knob(False, "Measure this node's links to every member in the background from the moment it "
                                      "joins (one TCP stream per ordered pair, timed by the receiver) and order the "
                                      "ring by them; measured links win over elastic.link_matrix.")
    link_probe_seconds: float = knob(2.0, "Seconds of data per background link measurement (elastic.measure_links).",
                                     check="positive")
    live_reco_addr: Optional[str] = knob(None, "Address this node's checkpoint sidecar advertises.",
                                         env="ZERO_BAND_LIVE_RECO_ADDR")
    live_reco_port: Optional[int] = knob(None, "Port of this node's checkpoint sidecar (default: random free port).",
                                         env="ZERO_BAND_LIVE_RECO_PORT")
    namespace: str = knob("", "Prefix of every key this node writes in the store: runs under different namespaces share "
                          "one store without seeing each other (DiLoCo-SWARM puts each stage's DiLoCo run under "
                          "swarm/s<stage>/ by itself).")
    status_interval: float = knob(5.0, "Seconds between this node's status records in the store (for `zb status` and its "
                                  "dashboard; also after every outer step); 0 publishes none.", check="non_negative")
    secret_file: Optional[str] = knob(None, "The run secret (a file; make one with `zb store --new-secret FILE`): every "
                                      "record this node writes to the store is sealed with it and every record read "
                                      "must open with it, so only nodes holding it join; the checkpoint sidecar's token "
                                      "derives from it. Also --secret-file.")


@dataclass
class SwarmConfig:
    stages: int = knob(2, "S: pipeline stages the model's blocks are split into (embeddings with the first, norm and "
                          "head with the last); each node serves one stage.", check="positive", run_defining=True)
    split: Optional[str] = knob(None, "Blocks per stage, comma separated (\"3,1\"); default: balanced by parameter count.",
                                run_defining=True)
    stage: Optional[int] = knob(None, "Serve this stage (0-based); default: the store picks the stage with the least "
                                "measured throughput per worker.", check="non_negative")
    max_in_flight: int = knob(4, "Micro-batches a first-stage worker keeps in flight through the pipeline at once.",
                              check="positive")
    hop_timeout: float = knob(30.0, "Seconds one hop (send, compute, answer) may take before the worker is dropped from "
                              "routing and the micro-batch is re-issued to another worker of the stage.", check="positive")
    stage_wait: float = knob(60.0, "Seconds a stage may have no live worker (or the run no first-stage worker) before "
                             "this worker gives up (exit 1).", check="positive")
    host: str = knob("127.0.0.1", "Address this worker listens on and advertises to the other stages' workers.")
    port: int = knob(0, "Port this worker listens on (0: a free port).", check="non_negative")


@dataclass
class Config:
    model: ModelConfig = section(ModelConfig, "The model.")
    train: TrainConfig = section(TrainConfig, "The training loop.")
    optim: OptimConfig = section(OptimConfig, "The inner optimizer and LR schedule.")
    data: DataConfig = section(DataConfig, "Training data.")
    eval: EvalConfig = section(EvalConfig, "Held-out evaluation.")
    log: LogConfig = section(LogConfig, "Logs and metrics.")
    elastic: ElasticConfig = section(ElasticConfig, "Membership: the global store, identity, heartbeats, timeouts.")
    ckpt: CkptConfig = section(CkptConfig, "Checkpoints and live recovery.")
    # Optional: without a [diloco] section zb train is plain FSDP2 on one node. Any diloco.* key
    # (or an empty [diloco] table) turns it on.
    diloco: Optional[DilocoConfig] = field(default=None, metadata={"doc": "DiLoCo across nodes.", "section": True,
                                                                   "optional": DilocoConfig})
    # Optional too: any swarm.* key turns `zb train` into a stage worker of a DiLoCo-SWARM run.
    swarm: Optional[SwarmConfig] = field(default=None, metadata={"doc": "DiLoCo-SWARM: pipeline stages over nodes.",
                                                                 "section": True, "optional": SwarmConfig})


# Every environment variable zb reads that is not a config key's twin, with what it does: the single
# list docs/reference.md is generated from (python -m zb.cli.reference), and tests/test_reference.py
# fails when the code reads a ZB_* variable that is neither here nor a twin. It lives here, beside the
# schema that defines the twins, because the two together are everything zb reads from the
# environment, and a base module is what both zb.config (which warns about unknown ZB_* names) and the
# generator can import without torch.
ENVIRONMENT: tuple[tuple[str, str], ...] = (
    ("ZB_CKPT_TOKEN", "The checkpoint sidecar's shared secret when the run has no elastic.secret_file (else "
                      "`zb ckpt-serve --token-file`). Never a config key, so it never lands in configs, "
                      "fingerprints or checkpoints."),
    ("ZB_USE_CPP", "Quantization kernels: 0 forces their PyTorch twins, 1 requires the C++ build, unset or "
                   "auto: C++ when it builds."),
    ("ZB_OPENMP", "Building the C++ kernels: 0 builds them without OpenMP, 1 requires it, unset or auto: with "
                  "it when the compiler has it."),
    ("ZB_DATA_CACHE", "Where Hugging Face data files are cached (default: huggingface_hub's cache); also "
                      "`zb subset-data --out`."),
    ("CXX", "The C++ compiler the kernels are built with (default: c++)."),
    ("GLOO_SOCKET_IFNAME", "The network interface gloo uses across nodes; its address is also the one the link "
                           "measurements use and elastic.link_matrix rows are matched by."),
    ("HF_ENDPOINT", "A Hugging Face mirror to fetch datasets and tokenizers from."),
    ("HF_HUB_OFFLINE", "1: never ask the Hugging Face hub; train from the files already cached."),
    ("WANDB_MODE", "log.wandb_mode = auto follows it (else online)."),
    ("TORCH_CPP_LOG_LEVEL", "torch's C++ log level; zb sets ERROR (zb status FATAL) unless it is set: at WARNING "
                            "each timed-out store wait logs two lines, each after a reverse DNS lookup."),
    ("LOCAL_RANK", "Set by the launcher (zb train --nproc-per-node, torchrun) for each rank: its local rank."),
    ("LOCAL_WORLD_SIZE", "Set by the launcher: the node's local ranks (else WORLD_SIZE, else 1)."),
    ("WORLD_SIZE", "Set by the launcher: the local ranks, when LOCAL_WORLD_SIZE is not."),
    ("RANK", "Set by the launcher; with MASTER_ADDR it means the process runs under torchrun."),
    ("MASTER_ADDR", "Set by the launcher; with RANK it means the process runs under torchrun."),
)
