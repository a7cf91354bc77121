"""Typed training configuration: a TOML file plus `--section.key value` overrides.

Every section is a dataclass; every key has a default. Unknown keys, wrong types
and impossible combinations raise `ConfigError` with one line naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from models.args import ModelArgs
from moevement.checkpoint.options import SparseOptions
from moevement.failures import END_PHASES, FaultPlan, FaultSpecError, KillEvent
from moevement.recovery.start_source import Source
from parallelisms.elastic import ElasticError, elastic_layout
from parallelisms.mesh import ParallelismConfig
from trainer.config_bounds import MAX_STEPS, bound_violation, excerpt
from trainer.strategy_registry import STRATEGIES

Strategy = Literal[tuple(STRATEGIES)]  # the registered names (trainer/strategy_registry.py)
INT64 = (-(2**63), 2**63 - 1)  # every integer key fits a signed 64-bit value (torch, numpy, file headers)
# job.name becomes a directory name under output_dir, host_dir and persist_dir: never a path, never hidden
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
INTERVAL_POLICIES = ("auto", "oracle", "capped")
MAX_CONFIG_BYTES = 16 << 20  # a config file: far more than every key's longest value takes
MAX_POISSON_FAILURES = 100_000  # the failures `fault.mtbf_iters` may draw over a run (drawn at start-up)


class ConfigError(ValueError):
    """A bad configuration value; the message names the key."""


@dataclass
class JobConfig:
    name: str = "moe"  # names the run: its host state, checkpoints and events
    seed: int = 0  # seeds the initial weights, data order and dropout
    output_dir: str = "outputs"  # each run's record and TensorBoard events go to <output_dir>/<name>/<timestamp>/


@dataclass
class DataConfig:
    """The ``[data]`` section of the training config."""

    dataset: str = "wikitext-2"  # a name under the data directory, a local file or directory, or a Hub id
    hub_config: str = ""  # configuration name of a Hub dataset
    train_split: str = "valid"  # split trained on (a file stem in a local directory)
    val_split: str = "test"  # split validated on ("": no validation data)
    text_field: str = "text"  # column of json/jsonl/parquet/hub rows; ignored for .txt files
    tokenizer: str = "byte"  # "byte" or a path to a tokenizer.json
    num_workers: int = 0  # StatefulDataLoader worker processes (0 = main process)
    cache_dir: str = ""  # Hugging Face datasets cache; "" = its default (HF_DATASETS_CACHE)


@dataclass
class TrainingConfig:
    steps: int = 100  # length of the run (the LR schedule spans it)
    stop_at: int = 0  # stop after this iteration, e.g. to save mid-run (0: run all steps)
    batch_size: int = 8  # global batch, in sequences
    micro_batches: int = 1  # gradient accumulation steps per iteration
    seq_len: int = 128  # tokens per sequence
    lr: float = 3e-4  # peak learning rate (AdamW)
    min_lr: float = 3e-5  # learning rate at the end of the cosine decay
    warmup_steps: int = 10  # linear warm-up iterations
    weight_decay: float = 0.1  # AdamW weight decay
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # global gradient-norm clipping (0: off)
    # tokens whose vocabulary logits the loss forms at once, again in backward (0: all of a micro-batch's)
    loss_chunk_tokens: int = 1024
    mixed_precision: Literal["fp32", "bf16"] = "fp32"  # fp32 | bf16 (FP32 master weights, bf16 compute weights)
    # CPU bf16 matrix products: native bf16 kernels, or SGEMM on the bf16 operands (fp32 accumulation,
    # 15x faster on CPUs without bf16 instructions); auto: fp32 unless the CPU has AVX512-BF16 / AMX
    cpu_bf16_gemm: Literal["auto", "native", "fp32"] = "auto"
    cpu_reuse_memory: bool = True  # CPU: keep freed large blocks in the heap (trainer/allocator.py)
    # CPU: how the OpenMP threads of a parallel region wait for work (OMP_WAIT_POLICY, set before torch starts;
    # a value in the environment wins): passive (they sleep at once) | active (they spin) | default (the
    # OpenMP runtime's own: libgomp spins ~0.3 M rounds, then sleeps). A replay on the cores its paused
    # neighbours leave idle is fastest with default (benchmarks.omp_wait); on cores shared with other processes
    # spinning threads keep the ones they wait for off the cores: passive (moevement/recovery/replay_threads.py)
    omp_wait_policy: Literal["passive", "active", "default"] = "default"
    val_every: int = 0  # validation loss every N iterations (0: none)
    val_batches: int = 4  # batches per validation
    deterministic: bool = True  # deterministic algorithms (bit-exact recovery needs them)
    # blocks that keep only their inputs and recompute their forward in backward: none | full (every block) |
    # selective (blocks with an even layer id); the same bits as none (parallelisms/activation_checkpoint.py)
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    # torch.compile each block's attention and dense or shared-expert FFN (routed experts stay eager); compiled
    # kernels may differ from eager in the last bits: compare a run with compiled runs (parallelisms/compile.py)
    compile: bool = False


@dataclass
class CheckpointConfig(SparseOptions):
    """The `[checkpoint]` section: MoEvement's keys (`SparseOptions`, listed first) and the trainer's."""

    strategy: Strategy = "none"  # none | moevement | gemini | checkfreq | moc | every_n (trainer/strategy_registry.py)
    save_final: str = ""  # directory for a dense checkpoint (safetensors + meta.json) at the end of training
    # directory of a dense checkpoint to start from when folder holds none of this run (an imported one: its
    # weights, a fresh optimizer)
    load: str = ""
    # a dense checkpoint after every N-th iteration, as <folder>/step-<N>, written in the background (0: none)
    dense_interval: int = 0
    keep_latest: int = 0  # periodic dense checkpoints of this run's lineage kept in folder: the newest N (0: all)
    folder: str = ""  # where periodic dense checkpoints go ("": <job.output_dir>/<job.name>/checkpoints)
    # -1: resume from the newest checkpoint of this run's config in folder, else checkpoint.load, else start
    # fresh (a folder of another config's checkpoints only is refused); N: from <folder>/step-<N>; 0: start over
    # (checkpoint.load or the initial state; the folder's checkpoints stay, and saves skip their steps)
    load_step: int = -1
    # load a dense checkpoint saved under another training config (fine-tuning); the differences are printed
    load_other_config: bool = False
    # auto: peers on this node copy from shared memory | network: all via the process group
    replication: Literal["auto", "network"] = "auto"
    host_dir: str = ""  # owner-only shared-memory directory for snapshots and replicas ("": /dev/shm/moevement-<uid>)
    # Interval baselines (gemini, checkfreq, moc)
    interval: str = "auto"  # N | oracle (best ETTR for the expected MTBF) | capped (overhead <= 3%) | auto
    mtbf_iters: float = 0.0  # the MTBF (iterations) the oracle interval optimises for (0: fault.mtbf_iters)
    moc_experts: int = 1  # MoC's K_pec: routed experts saved per MoE layer per checkpoint (initially)
    moc_plt_threshold: float = 0.0375  # MoC doubles K_pec when the proportion of lost tokens exceeds this


@dataclass
class FaultConfig:
    at: str = ""  # STEP:RANK[+RANK...][,...]: these ranks lose their state at STEP and recover in place
    crash: str = ""  # STEP:RANK[,...]: the process exits at STEP (first attempt), for torchrun restarts
    # STEP:RANK[:PHASE][,...]: the process SIGKILLs itself in PHASE: forward (default), backward, clip,
    # optimizer, snapshot, replication, validation, replay, join (a survivor joining the next generation),
    # dense_save or dense_prune (a periodic checkpoint's writing, or pruning after it), or at the end of a run
    # whose last step is STEP: digest, accounting, saved (save_final published) or final
    kill: str = ""
    # how fault.kill strikes: SIGKILL (a death) | SIGSTOP (a hang)
    kill_signal: Literal["SIGKILL", "SIGSTOP"] = "SIGKILL"
    timeout_s: float = 600.0  # a collective without progress for this long fails: a hung peer counts as dead
    # under rank shells: a trainer without a heartbeat for this long is frozen (its shell kills it and its standby
    # replaces it); a shell silent for this long is stuck (its trainer kills it: torchrun restarts or ends the job)
    heartbeat_timeout_s: float = 30.0
    # under rank shells: a node none of whose trainers said it is there for this long is lost with its ranks;
    # the survivors stop waiting to replace them in place and hand over to torchrun's restart
    node_loss_s: float = 60.0
    # under torchrun, dead workers a rank shell replaces in place before torchrun's restart takes over
    max_replacements: int = 4
    # localized: the failed stages roll back | global: every stage does (for comparison)
    scope: Literal["localized", "global"] = "localized"
    replay_threads: int = 0  # CPU threads of a replaying rank (0: auto, the cores its paused neighbours leave idle)
    # under rank shells: a standby builds, before its activation, what does not depend on the dead rank's
    # state: the data pipeline and, on CPU, its stages' weights (trainer/run/prebuilt.py); false: it builds
    # them after its activation
    standby_prebuild: bool = True
    # a prebuilding standby also runs one throwaway forward and backward through a copy of its stages: the
    # replacement's first replayed iteration is spared the kernels' first calls and the heap's growth, for
    # about that much CPU time in the standby and its heap kept resident (docs/configuration.md)
    standby_warm_up: bool = False
    # under rank shells: when a standby starts importing and prebuilding: when_training (once its slot's
    # trainer trains, its generation set up and any recovery done, so that it never competes with a replay
    # for the cores) | at_once (as soon as it starts)
    standby_prepare: Literal["when_training", "at_once"] = "when_training"
    # a replay's frozen operators still compute their weight gradient, then drop it (the ablation of the
    # paper's Figure 13; false: skipped, MoEvement's design)
    frozen_weight_grad: bool = False
    mtbf_iters: float = 0.0  # Poisson failures of random ranks, mean time between failures in iterations (0: none)
    seed: int = 0  # seed of the Poisson failure schedule
    trace: str = ""  # CSV of failures: `iteration,rank` or `time_s,rank` rows


@dataclass
class MetricsConfig:
    log_every: int = 1  # print a step line every N iterations (events.jsonl records every one)
    tensorboard: bool = True  # write TensorBoard events into the run folder
    tensorboard_every: int = 10  # every N iterations, every stage's expert load and snapshot figures
    progress: bool = True  # progress bar on an interactive console
    cpu_cost: bool = False  # each rank prints the CPU seconds of its checkpointing activities at the end
    # JSON file: Algorithm 1's last inputs on rank 0 (T, per-operator bytes, copy bandwidth, W), written at the
    # end for `python -m simulator --window-profile` (checkpoint.strategy = moevement)
    profile: str = ""
    # the device's dense bf16 peak, TFLOP/s, that the step line's mfu= divides by (0: the peak of a known GPU;
    # none on CPU, where the step line has no mfu=)
    peak_tflops: float = 0.0


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read `path` (TOML), apply `--section.key value` overrides, validate."""
    cfg = Config()
    if path is not None:
        _apply_table(cfg, _read_table(path))
    for key, raw in _parse_overrides(cfg, overrides):
        section, name = _lookup(cfg, key)
        setattr(section, name, _coerce(key, raw, _field_type(section, name), from_cli=True))
    validate(cfg)
    return cfg


def _read_table(path: str) -> dict:
    """The TOML table of the config file at `path` (ConfigError: missing, unreadable, too large, not TOML,
    or empty)."""
    name = excerpt(path, 200, quoted=False)
    try:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file not found: {name}")
        with file.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:  # a name too long for the file system among them
        raise ConfigError(f"config file {name}: unreadable ({e.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{name}: larger than {MAX_CONFIG_BYTES >> 20} MiB: not a config file")
    try:
        table = tomllib.loads(data.decode())
    except ValueError as e:  # TOMLDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise ConfigError(f"{name}: invalid TOML: {excerpt(str(e), 200, quoted=False)}") from None
    if not table:
        raise ConfigError(f"{name}: the config file sets nothing (empty or only comments)")
    return table


def _apply_table(cfg: Config, table: dict) -> None:
    for section_name, values in table.items():
        if section_name not in _sections(cfg):
            near = _close_matches(section_name, _sections(cfg))
            hint = f"did you mean [{near[0]}]? " if near else ""
            allowed = ", ".join(_sections(cfg))
            raise ConfigError(
                f"unknown config section [{excerpt(section_name, quoted=False)}] ({hint}allowed: {allowed})"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"config section [{section_name}] must be a table")
        for name, value in values.items():
            key = f"{section_name}.{name}"
            section, name = _lookup(cfg, key)
            setattr(section, name, _coerce(key, value, _field_type(section, name), from_cli=False))


def _parse_overrides(cfg: Config, args: list[str]) -> list[tuple[str, str]]:
    """``[(key, raw value)]`` of ``--section.key value``, ``--section.key=value`` and, for a bool key, a bare
    ``--section.key`` (true)."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {excerpt(arg)} (overrides look like --section.key value)")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, raw = arg[2:], args[i + 1]
            i += 2
        elif _field_type(*_lookup(cfg, arg[2:])) is bool:
            key, raw = arg[2:], "true"
            i += 1
        else:
            raise ConfigError(f"missing value for {excerpt(arg, quoted=False)}")
        pairs.append((key, raw))
    return pairs


def _sections(cfg: Config) -> list[str]:
    return [f.name for f in dataclasses.fields(cfg)]


def _all_keys(cfg: Config) -> list[str]:
    return [f"{s}.{f.name}" for s in _sections(cfg) for f in dataclasses.fields(getattr(cfg, s))]


def _key_of_name(cfg: Config) -> dict[str, str]:
    """{name: section.name} over all sections (the first section for a name several have)."""
    keys = {}
    for key in _all_keys(cfg):
        keys.setdefault(key.partition(".")[2], key)
    return keys


def _close_matches(name: str, candidates) -> list[str]:
    """The candidate nearest `name`, if any is near (none for a name far longer than any key)."""
    return difflib.get_close_matches(name, candidates, n=1) if len(name) <= 100 else []


def _did_you_mean(key: str, candidates: list[str], section: str = "") -> str:
    """``"did you mean '<nearest>'? "`` (prefixed by ``section.``), or "" when no candidate is near."""
    close = _close_matches(key, candidates)
    return f"did you mean '{section + '.' if section else ''}{close[0]}'? " if close else ""


def _lookup(cfg: Config, key: str):
    section_name, _, name = key.partition(".")
    if section_name not in _sections(cfg):
        hint = _did_you_mean(key, _all_keys(cfg))
        raise ConfigError(f"unknown config key {excerpt(key)} ({hint}sections: {', '.join(_sections(cfg))})")
    section = getattr(cfg, section_name)
    names = [f.name for f in dataclasses.fields(section)]
    if name not in names:
        hint = _did_you_mean(name, names, section_name) if name not in _key_of_name(cfg) else ""
        if not hint:  # the name (or a near one) of another section's key
            near = _close_matches(name, _key_of_name(cfg))
            hint = f"did you mean '{_key_of_name(cfg)[near[0]]}'? " if near else ""
        raise ConfigError(f"unknown config key {excerpt(key)} ({hint}allowed in [{section_name}]: {', '.join(names)})")
    return section, name


def _field_type(section, name: str) -> type:
    return typing.get_type_hints(type(section))[name]


def choices(kind) -> tuple | None:
    """The allowed values of a ``Literal[...]`` field type, else None."""
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def _coerce(key: str, value, kind, from_cli: bool):
    if choices(kind):  # a Literal of strings: a str, checked against the choices by validate()
        kind = str
    if from_cli:
        value = _parse_cli_value(key, value, kind)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not kind:
        shown = excerpt(repr(value), quoted=False)
        raise ConfigError(f"config key '{key}' must be {kind.__name__}, got {type(value).__name__} {shown}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
    if kind is int and not INT64[0] <= value <= INT64[1]:
        raise ConfigError(
            f"config key '{key}' must fit a signed 64-bit integer, got {excerpt(str(value), quoted=False)}"
        )
    return value


def _parse_cli_value(key: str, raw: str, kind: type):
    try:
        if kind is bool:
            lowered = raw.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise ConfigError(f"config key '{key}' must be {kind.__name__}, got {excerpt(raw)}") from None


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"config key '{key}' {message}")


def validate(cfg: Config) -> None:
    """Every key within its bound (trainer/config_bounds.py) and among its choices, then what keys mean
    together; raise ConfigError naming the first bad key."""
    for key in _all_keys(cfg):
        section, name = _lookup(cfg, key)
        allowed, value = choices(_field_type(section, name)), getattr(section, name)
        broken = bound_violation(key, value)
        _check(broken is None, key, broken or "")
        if allowed:
            _check(value in allowed, key, f"must be one of {', '.join(allowed)}, got {value!r}")
    try:
        cfg.model.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _validate_job(cfg.job)
    t = cfg.training
    _check(
        t.batch_size % t.micro_batches == 0,
        "training.batch_size",
        f"({t.batch_size}) must be divisible by training.micro_batches ({t.micro_batches})",
    )
    _check(
        t.seq_len <= cfg.model.max_seq_len,
        "training.seq_len",
        f"({t.seq_len}) must be at most model.max_seq_len ({cfg.model.max_seq_len})",
    )
    _check(t.stop_at <= t.steps, "training.stop_at", f"must be in [0, training.steps], got {t.stop_at}")
    _check(t.min_lr <= t.lr, "training.min_lr", f"must be in [0, training.lr], got {t.min_lr}")
    _validate_parallelism(cfg)
    _validate_checkpoint(cfg)
    _validate_fault(cfg)
    _check(
        not cfg.metrics.profile or STRATEGIES[cfg.checkpoint.strategy].window_profile,
        "metrics.profile",
        f"writes MoEvement's window profile: needs checkpoint.strategy = moevement, got {cfg.checkpoint.strategy!r}",
    )


def safe_job_name(text: str) -> str:
    """`text` made a valid job.name: other characters become '_' (a directory's name, for example)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip("._-")[:100]
    return name or JobConfig.name


def _validate_job(job: JobConfig) -> None:
    _check(
        JOB_NAME.fullmatch(job.name) is not None,
        "job.name",
        f"must be 1-100 letters, digits, '.', '_' or '-', not starting with '.', '_' or '-'; got {job.name!r}",
    )


def _validate_checkpoint(cfg: Config) -> None:
    c = cfg.checkpoint
    check = STRATEGIES[c.strategy].check
    if check is not None and (broken := check(cfg)) is not None:
        _check(False, *broken)  # the strategy's own needs (its registry entry)
    _check(
        c.ab_blocks == 0 or c.window == 1,
        "checkpoint.ab_blocks",
        f"needs checkpoint.window 1 (its blocks take single snapshots), got window {c.window}",
    )
    operators = operator_count(cfg.model)
    _check(
        c.window <= operators,
        "checkpoint.window",
        f"({c.window}) must be at most the model's {operators} operators (a slot each at least; more would be empty)",
    )
    _check(
        c.interval in INTERVAL_POLICIES or (c.interval.isdigit() and 1 <= int(c.interval) <= MAX_STEPS),
        "checkpoint.interval",
        f"must be an integer in [1, {MAX_STEPS}] or one of {', '.join(INTERVAL_POLICIES)}, got {c.interval!r}",
    )
    _check(
        not (c.load_step > 0 and c.load),
        "checkpoint.load_step",
        f"names a periodic checkpoint, and checkpoint.load ({c.load!r}) another: give one of them",
    )


def _validate_fault(cfg: Config) -> None:
    f = cfg.fault
    _check(
        f.mtbf_iters == 0 or f.mtbf_iters >= 1,
        "fault.mtbf_iters",
        f"must be 0 (no failures) or at least 1 iteration between failures, got {f.mtbf_iters}",
    )
    last = cfg.training.stop_at or cfg.training.steps
    _check(
        not f.mtbf_iters or last / f.mtbf_iters <= MAX_POISSON_FAILURES,
        "fault.mtbf_iters",
        f"({f.mtbf_iters:g}) would draw about {last / (f.mtbf_iters or 1):.0f} failures over the run's {last} "
        f"iterations, more than {MAX_POISSON_FAILURES}: give at least {last / MAX_POISSON_FAILURES:g}",
    )
    plan = fault_plan(cfg, world=2)
    for kill in plan.kills if plan else ():
        _validate_kill(cfg, kill)
    if plan:
        given = {"fault.at": f.at, "fault.crash": f.crash, "fault.kill": f.kill, "fault.mtbf_iters": f.mtbf_iters}
        key = next((k for k, v in given.items() if v), "fault.trace")
        recovering = ", ".join(name for name, entry in STRATEGIES.items() if entry.recovers)
        _check(
            STRATEGIES[cfg.checkpoint.strategy].recovers,
            key,
            f"needs a checkpoint.strategy that recovers ({recovering}), got {cfg.checkpoint.strategy!r}",
        )
    if cfg.checkpoint.interval == "oracle":
        _check(
            expected_mtbf_iters(cfg) > 0,
            "checkpoint.interval",
            "oracle needs checkpoint.mtbf_iters or fault.mtbf_iters > 0 (the MTBF it optimises for)",
        )


def operator_count(model: ModelArgs) -> int:
    """How many operators `moevement.operators.build_registry` finds in the whole model of shape `model` (all
    pipeline stages together, without building it): a block per layer; per MoE layer its router, its routed
    experts and, when it has any, its shared experts (one operator); the embedding and the head."""
    moe_layers = sum(model.is_moe_layer(layer) for layer in range(model.n_layers))
    shared = model.family == "qwen" or (model.family != "gpt" and model.n_shared_experts > 0)
    return model.n_layers + moe_layers * (1 + model.n_routed_experts + shared) + 2


def _validate_kill(cfg: Config, kill: KillEvent) -> None:
    """A `fault.kill` must strike at a point this run reaches."""
    every = cfg.training.val_every
    _check(
        kill.phase != "validation" or (every and kill.step % every == 0),
        "fault.kill",
        f"kills in the validation of step {kill.step}, which runs none (training.val_every={every})",
    )
    last = cfg.training.stop_at or cfg.training.steps
    _check(
        kill.phase not in END_PHASES or kill.step == last,
        "fault.kill",
        f"kills in the {kill.phase} phase at the end of a run, whose last step is {last}, not {kill.step}",
    )
    _check(
        kill.phase not in ("save", "saved") or bool(cfg.checkpoint.save_final),
        "fault.kill",
        f"kills in the {kill.phase} phase of checkpoint.save_final, which this run does not set",
    )
    interval = cfg.checkpoint.dense_interval
    _check(
        kill.phase not in ("dense_save", "dense_prune") or (interval and kill.step % interval == 0),
        "fault.kill",
        f"kills while the periodic checkpoint of step {kill.step} is written or pruned after, which this run "
        f"does not save (checkpoint.dense_interval={interval})",
    )
    _check(
        kill.phase != "dense_prune" or cfg.checkpoint.keep_latest > 0,
        "fault.kill",
        "kills while older periodic checkpoints are pruned, which this run does not (checkpoint.keep_latest=0)",
    )


def expected_mtbf_iters(cfg: Config) -> float:
    """The MTBF in iterations the interval baselines plan for: `checkpoint.mtbf_iters`, else the injected
    failures' `fault.mtbf_iters` (0: unknown)."""
    return cfg.checkpoint.mtbf_iters or cfg.fault.mtbf_iters


def fault_plan(cfg: Config, world: int) -> FaultPlan:
    """The run's failure schedule (`fault.*` keys), for `world` ranks."""
    f = cfg.fault
    try:
        return FaultPlan(
            f.at,
            f.crash,
            kill=f.kill,
            mtbf_iters=f.mtbf_iters,
            seed=f.seed,
            trace=f.trace,
            world=world,
            last_step=cfg.training.stop_at or cfg.training.steps,
        )
    except FaultSpecError as e:
        raise ConfigError(str(e)) from None


def _validate_parallelism(cfg: Config) -> None:
    p, t, m = cfg.parallelism, cfg.training, cfg.model
    if p.elastic:
        _validate_elastic(cfg)
    _check(p.dp % p.ep == 0, "parallelism.ep", f"({p.ep}) must divide parallelism.dp ({p.dp})")
    _check(
        p.pp * p.stages_per_rank == 1 or m.aux_loss_type != "global" or m.aux_loss_coef == 0,
        "model.aux_loss_type",
        "'global' is one loss over every MoE layer, which pipeline parallelism splits across stages: "
        "use 'batch' or 'seq' with parallelism.pp > 1",
    )
    _check(
        m.n_routed_experts % p.ep == 0,
        "parallelism.ep",
        f"({p.ep}) must divide model.n_routed_experts ({m.n_routed_experts})",
    )
    _check_expert_sharding(cfg)
    interleaved = p.schedule == "Interleaved1F1B"
    _check(
        interleaved == (p.stages_per_rank > 1),
        "parallelism.stages_per_rank",
        f"({p.stages_per_rank}) must be >= 2 exactly when parallelism.schedule is Interleaved1F1B",
    )
    n_stages = p.pp * p.stages_per_rank
    _check(
        n_stages <= m.n_layers,
        "parallelism.pp",
        f"x parallelism.stages_per_rank ({n_stages} stages) must be at most model.n_layers ({m.n_layers})",
    )
    if p.pp > 1:
        _check(
            t.micro_batches >= p.pp,
            "training.micro_batches",
            f"({t.micro_batches}) must be at least parallelism.pp ({p.pp}) for the pipeline schedule",
        )
        _check(
            not interleaved or t.micro_batches % p.pp == 0,
            "training.micro_batches",
            f"({t.micro_batches}) must be a multiple of parallelism.pp ({p.pp}) for Interleaved1F1B",
        )
    _check(
        t.batch_size % (t.micro_batches * p.dp) == 0,
        "training.batch_size",
        f"({t.batch_size}) must be divisible by training.micro_batches x parallelism.dp ({t.micro_batches * p.dp})",
    )
    if p.split_points:
        try:
            points = [int(x) for x in p.split_points.split(",")]
        except ValueError:
            points = None
        ok = points is not None and len(points) == n_stages - 1 and points == sorted(set(points))
        _check(
            ok and all(0 < x < m.n_layers for x in points),
            "parallelism.split_points",
            f"must be {n_stages - 1} increasing layer ids in (0, {m.n_layers}), "
            f"comma-separated, got {excerpt(p.split_points)}",
        )


def _check_expert_sharding(cfg: Config) -> None:
    """FSDP shards each stacked expert weight along its second dimension (`parallelisms.fsdp`: model.dim for
    w2, model.expert_hidden_dim for w1 and w3) over the ranks holding the same experts, and cannot shard it
    unevenly there."""
    p, m = cfg.parallelism, cfg.model
    shards = p.dp // p.ep  # the data-parallel ranks holding the same experts
    if shards == 1 or not m.n_routed_experts:
        return
    for key, size in (("model.dim", m.dim), ("model.expert_hidden_dim", m.expert_hidden_dim)):
        _check(
            size % shards == 0,
            key,
            f"({size}) must be divisible by the {shards} ranks that shard each routed expert "
            f"(parallelism.dp / parallelism.ep): FSDP shards every stacked "
            "expert weight along it and cannot shard it unevenly",
        )


def fit_world(cfg: Config, world_size: int) -> Config:
    """The config this run trains with on `world_size` processes: `cfg` itself where pp x dp is the world;
    with `parallelism.elastic`, the layout `parallelisms.elastic` gives that world (ConfigError naming the key
    when none fits). Fault ranks must exist."""
    p = cfg.parallelism
    if p.elastic and p.pp * p.dp != world_size:
        try:
            layout = elastic_layout(p, cfg.training.micro_batches, world_size)
        except ElasticError as e:
            raise ConfigError(f"config key 'parallelism.elastic': {e}") from None
        training = dataclasses.replace(cfg.training, micro_batches=layout.micro_batches)
        cfg = dataclasses.replace(cfg, parallelism=layout.parallelism, training=training)
        _check_expert_sharding(cfg)
    check_world_size(cfg, world_size)
    return cfg


def _validate_elastic(cfg: Config) -> None:
    """An elastic job resumes from its newest periodic dense checkpoint, the one state every layout loads."""
    c = cfg.checkpoint
    _check(
        c.dense_interval > 0,
        "parallelism.elastic",
        "resumes from periodic dense checkpoints: set checkpoint.dense_interval (iterations between them)",
    )
    _check(
        not c.persist_dir or Source.PERSISTED_WINDOW in STRATEGIES[c.strategy].restores,
        "checkpoint.persist_dir",
        "is read by an elastic job with checkpoint.strategy moevement only (each torchrun round starts from the "
        "newest dense checkpoint; a baseline recovers in place from memory): leave it unset",
    )
    _check(
        c.load_step == -1,
        "checkpoint.load_step",
        f"is chosen by parallelism.elastic (the newest checkpoint in checkpoint.folder): leave it -1, "
        f"got {c.load_step}",
    )


def check_world_size(cfg: Config, world_size: int) -> None:
    """The launched process count must equal pp x dp; fault ranks must exist."""
    p = cfg.parallelism
    _check(
        p.pp * p.dp == world_size,
        "parallelism.pp",
        f"x parallelism.dp ({p.pp} x {p.dp}) must equal the number of processes ({world_size})",
    )
    try:
        fault_plan(cfg, world_size).check_world(world_size)
    except FaultSpecError as e:
        raise ConfigError(str(e)) from None
