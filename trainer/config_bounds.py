"""The bound of every config key: a range for each number, a length and a content for each string.

Every int, float and str key of the config dataclasses has one entry in `BOUNDS` (a test holds the table to
the dataclasses), so that no value, however absurd, reaches code that would hang, exhaust memory or fail with
a traceback on it: `validate` (trainer/config.py) checks them all first, and refuses the first value out of
bounds with one line naming the key (a long value quoted by an excerpt, `excerpt`). The bounds are far
beyond any real run; what a key means within them (`training.stop_at` <= `training.steps`, a window no
longer than the model has operators, ...) is checked afterwards, by `validate`. Imports nothing of the
trainer: trainer/config.py raises the errors.
"""

from __future__ import annotations

from dataclasses import dataclass

INT64_MAX = 2**63 - 1  # a seed: any non-negative 64-bit value
MAX_STEPS = 10**9  # any count of iterations: a run's length, an interval, a step to load
MAX_WINDOW = 1024  # MoEvement's window W: a recovery replays up to 2W iterations, a snapshot set is 2W buffers
MAX_WIDTH = 1 << 18  # a hidden size of the model
MAX_LAYERS = 1 << 12  # transformer blocks (and pipeline stages, which hold at least one each)
MAX_EXPERTS = 1 << 14  # routed experts of a MoE layer
MAX_COEFFICIENT = 1e6  # a learning rate, a loss weight, an AdamW constant, a clipping norm
MAX_SECONDS = 7 * 24 * 3600.0  # a timeout: a week
NODE_LOSS_MIN_S = 3.0  # fault.node_loss_s: at least a few of the trainers' 1 s beats
NAME_MAX = 255  # bytes of a file name (one path component), as Linux file systems allow
PATH_BYTES = 1024  # a path the trainer adds its own names below, well under Linux's PATH_MAX (4096)
NAME_CHARS = 255  # a name, a split, a column, a choice
SPEC_CHARS = 8192  # a list: failures (`fault.at`), split points
EXCERPT_CHARS = 60  # what an error line quotes of a long value


def excerpt(text: str, limit: int = EXCERPT_CHARS, quoted: bool = True) -> str:
    """`text` (`quoted` as Python writes a string) whole when short, else its first `limit` characters and
    its length: an error line that names a value stays short whatever its size."""
    show = repr if quoted else str
    if len(text) <= limit:
        return show(text)
    return f"{show(text[:limit])}... ({len(text)} characters)"


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Span:
    """A number key's range: `lo` to `hi`, each end included unless `open_lo` / `open_hi`. `low` and `high`:
    the rule a value below or above it breaks, as the error line says it (default: `must be >= lo`, `must be
    at most hi`; `rule` sets both)."""

    lo: float
    hi: float
    low: str = ""
    high: str = ""
    open_lo: bool = False
    open_hi: bool = False
    rule: str = ""

    def violation(self, value: float) -> str | None:
        """What `value` breaks ("must be ..., got <value>"), or None within the range."""
        if value < self.lo or (self.open_lo and value == self.lo):
            rule = self.rule or self.low or f"must be {'>' if self.open_lo else '>='} {_number(self.lo)}"
        elif value > self.hi or (self.open_hi and value == self.hi):
            rule = self.rule or self.high or f"must be {'below' if self.open_hi else 'at most'} {_number(self.hi)}"
        else:
            return None
        return f"{rule}, got {_number(value)}"


@dataclass(frozen=True)
class Text:
    """A string key: at most `limit` characters of UTF-8 text without control characters; a `path` counts
    bytes, as the file system does, and none of its components may be longer than `NAME_MAX` bytes."""

    limit: int
    path: bool = False

    def violation(self, value: str) -> str | None:
        """What `value` breaks, or None."""
        if len(value) > self.limit:  # before encoding it: a huge value is refused without a copy
            return f"must be at most {self._unit()}, got {excerpt(value)}"
        try:
            encoded = value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"must be UTF-8 text, got {excerpt(value)} (an undecodable byte at character {e.start})"
        control = next((i for i, ch in enumerate(value) if ord(ch) < 32 or ord(ch) == 127), None)
        if control is not None:
            return f"must not hold control characters, got {value[control]!r} at character {control}"
        if self.path and len(encoded) > self.limit:
            return f"must be at most {self._unit()}, got {len(encoded)} bytes: {excerpt(value)}"
        long_part = next((part for part in value.split("/") if len(part.encode()) > NAME_MAX), None)
        if self.path and long_part is not None:
            return (
                f"has a path component of {len(long_part.encode())} bytes, longer than a file name may be "
                f"({NAME_MAX}): {excerpt(long_part)}"
            )
        return None

    def _unit(self) -> str:
        return f"{self.limit} bytes (a path)" if self.path else f"{self.limit} characters"


PATH = Text(PATH_BYTES, path=True)
NAME = Text(NAME_CHARS)
SPEC = Text(SPEC_CHARS)
SEED = Span(0, INT64_MAX)
STEPS = Span(0, MAX_STEPS)  # an iteration count or interval where 0 means none
EVERY = Span(1, MAX_STEPS)  # an interval of at least one iteration
POSITIVE_STEPS = Span(1, MAX_STEPS, low="must be positive")
COEFFICIENT = Span(0, MAX_COEFFICIENT)
WIDTH = Span(1, MAX_WIDTH)
IN_0_1_OPEN = Span(0, 1, open_lo=True, open_hi=True, rule="must be in (0, 1)")
IN_0_1_HALF_OPEN = Span(0, 1, open_hi=True, rule="must be in [0, 1)")
WINDOW_RULE = f"must be at most {MAX_WINDOW} (a recovery replays up to 2W iterations)"

BOUNDS: dict[str, Span | Text] = {
    "job.name": NAME,
    "job.seed": SEED,
    "job.output_dir": PATH,
    "model.family": NAME,
    "model.vocab_size": Span(1, 1 << 24),
    "model.dim": WIDTH,
    "model.n_layers": Span(1, MAX_LAYERS),
    "model.n_heads": Span(1, MAX_WIDTH),
    "model.n_kv_heads": Span(0, MAX_WIDTH),
    "model.rope_theta": Span(0, 1e12, open_lo=True),
    "model.norm_eps": Span(0, 1, open_lo=True),
    "model.max_seq_len": Span(1, 1 << 20, high="must be at most 1048576 (its rotary tables are built at start)"),
    "model.dropout": IN_0_1_HALF_OPEN,
    "model.n_dense_layers": Span(0, MAX_LAYERS),
    "model.dense_hidden_dim": WIDTH,
    "model.n_routed_experts": Span(1, MAX_EXPERTS),
    "model.n_shared_experts": Span(0, 1 << 10),
    "model.expert_hidden_dim": WIDTH,
    "model.shared_expert_hidden_dim": WIDTH,
    "model.top_k": Span(1, MAX_EXPERTS),
    "model.aux_loss_coef": COEFFICIENT,
    "model.aux_loss_type": NAME,
    "model.router_z_loss_coef": COEFFICIENT,
    "model.capacity_factor": COEFFICIENT,
    "model.moe_every": Span(1, MAX_LAYERS),
    "data.dataset": PATH,
    "data.hub_config": NAME,
    "data.train_split": NAME,
    "data.val_split": NAME,
    "data.text_field": NAME,
    "data.tokenizer": PATH,
    "data.num_workers": Span(0, 64),
    "data.cache_dir": PATH,
    "training.steps": POSITIVE_STEPS,
    "training.stop_at": STEPS,
    "training.batch_size": Span(1, 1 << 24, low="must be positive"),
    "training.micro_batches": Span(1, 1 << 24, low="must be positive"),
    "training.seq_len": Span(1, 1 << 20, low="must be positive"),
    "training.lr": Span(0, MAX_COEFFICIENT, open_lo=True, low="must be positive"),
    "training.min_lr": COEFFICIENT,
    "training.warmup_steps": STEPS,
    "training.weight_decay": COEFFICIENT,
    "training.beta1": IN_0_1_HALF_OPEN,
    "training.beta2": IN_0_1_HALF_OPEN,
    "training.eps": Span(0, MAX_COEFFICIENT, open_lo=True, low="must be positive (AdamW divides by it)"),
    "training.max_grad_norm": COEFFICIENT,
    "training.loss_chunk_tokens": Span(0, 1 << 30),
    "training.mixed_precision": NAME,
    "training.cpu_bf16_gemm": NAME,
    "training.val_every": STEPS,
    "training.val_batches": Span(1, 1 << 20, low="must be positive"),
    "training.activation_checkpoint": NAME,
    "training.omp_wait_policy": NAME,
    "parallelism.pp": Span(1, MAX_LAYERS),
    "parallelism.dp": Span(1, 1 << 16),
    "parallelism.ep": Span(1, 1 << 16),
    "parallelism.schedule": NAME,
    "parallelism.stages_per_rank": Span(1, MAX_LAYERS),
    "parallelism.split_points": SPEC,
    "checkpoint.window": Span(
        0, MAX_WINDOW, high=f"must be at most {MAX_WINDOW} (a recovery replays up to 2W iterations)"
    ),
    "checkpoint.max_window": Span(
        1, MAX_WINDOW, high=f"must be at most {MAX_WINDOW} (a recovery replays up to 2W iterations)"
    ),
    "checkpoint.slots": NAME,
    "checkpoint.ordering": NAME,
    "checkpoint.overlap": NAME,
    "checkpoint.ema_decay": IN_0_1_OPEN,
    "checkpoint.replicas": Span(0, 1 << 10),
    "checkpoint.bandwidth_gbps": COEFFICIENT,
    "checkpoint.background_priority": NAME,
    "checkpoint.chunk_mb": Span(1, 1 << 10, high="must be at most 1024 (a GPU's staging ring holds 2 chunks)"),
    "checkpoint.persist_dir": PATH,
    "checkpoint.persist_every": EVERY,
    "checkpoint.profile_iters": EVERY,
    "checkpoint.reprofile_every": STEPS,
    "checkpoint.ab_blocks": STEPS,
    "checkpoint.strategy": NAME,
    "checkpoint.save_final": PATH,
    "checkpoint.load": PATH,
    "checkpoint.dense_interval": STEPS,
    "checkpoint.keep_latest": STEPS,
    "checkpoint.folder": PATH,
    "checkpoint.load_step": Span(-1, MAX_STEPS, low="must be >= 0, or -1 (the newest)"),
    "checkpoint.replication": NAME,
    "checkpoint.host_dir": PATH,
    "checkpoint.interval": NAME,
    "checkpoint.mtbf_iters": Span(0, 1e12),
    "checkpoint.moc_experts": Span(1, MAX_EXPERTS),
    "checkpoint.moc_plt_threshold": IN_0_1_OPEN,
    "fault.at": SPEC,
    "fault.crash": SPEC,
    "fault.kill": SPEC,
    "fault.kill_signal": NAME,
    "fault.timeout_s": Span(0, MAX_SECONDS, open_lo=True, low="must be > 0 seconds"),
    "fault.heartbeat_timeout_s": Span(
        3.0, 3600.0, rule="must be 3 to 3600 seconds (a few 1 s heartbeats, at most an hour)"
    ),
    "fault.node_loss_s": Span(
        NODE_LOSS_MIN_S,
        MAX_SECONDS,
        low=f"must be >= {NODE_LOSS_MIN_S:g} seconds (a few of the trainers' 1 s beats)",
    ),
    "fault.max_replacements": Span(0, 1 << 20),
    "fault.scope": NAME,
    "fault.standby_prepare": NAME,
    "fault.replay_threads": Span(0, 1024, low="must be >= 0 (0: auto)"),
    "fault.mtbf_iters": Span(0, 1e12, low="must be 0 (no failures) or at least 1 iteration between failures"),
    "fault.seed": SEED,
    "fault.trace": PATH,
    "metrics.log_every": EVERY,
    "metrics.tensorboard_every": EVERY,
    "metrics.profile": PATH,
    "metrics.peak_tflops": Span(0, MAX_COEFFICIENT, low="must be >= 0 (0: the known peak of the device)"),
}


def bound_violation(key: str, value: object) -> str | None:
    """What `value` of config key `key` breaks of its bound (the rest of the error line after the key), or
    None. A key without a bound (a bool) has nothing to break."""
    bound = BOUNDS.get(key)
    if bound is None or isinstance(value, bool):
        return None
    return bound.violation(value)
