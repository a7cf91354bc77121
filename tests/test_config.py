"""Config loading: TOML + overrides, and one clear error naming the key."""

import dataclasses
import typing

import pytest

from tests.helpers import DEBUG_CONFIG, ROOT
from trainer.config import Config, ConfigError, choices, load_config
from trainer.config_help import config_keys


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_debug_config_loads_and_overrides_apply():
    cfg = load_config(
        str(ROOT / DEBUG_CONFIG),
        ["--training.steps", "7", "--training.lr=0.001", "--metrics.tensorboard", "false", "--model.dropout", "0.1"],
    )
    assert cfg.training.steps == 7
    assert cfg.training.lr == 0.001
    assert cfg.metrics.tensorboard is False
    assert cfg.model.dropout == 0.1


@pytest.mark.parametrize(
    "text, key",
    [
        ("[training]\nstepz = 3\n", "training.stepz"),
        ("[trainin]\nsteps = 3\n", "[trainin]"),
        ("[training]\nsteps = 'many'\n", "training.steps"),
        ("[training]\nlr = true\n", "training.lr"),
        ("[training]\nbatch_size = 6\nmicro_batches = 4\n", "training.batch_size"),
        ("[training]\nmixed_precision = 'fp8'\n", "training.mixed_precision"),
        ("[checkpoint]\nstrategy = 'magic'\n", "checkpoint.strategy"),
        ("[model]\ntop_k = 99\n", "model.top_k"),
        ("[model]\nfamily = 'llama'\n", "model.family"),
    ],
)
def test_bad_file_values_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    "args, key",
    [
        (["--training.steps", "x"], "training.steps"),
        (["--training.nope", "1"], "training.nope"),
        (["--metrics.tensorboard", "maybe"], "metrics.tensorboard"),
        (["--training.steps"], "training.steps"),
        (["--model.aux_loss_type", "global", "--parallelism.pp", "2"], "model.aux_loss_type"),
        # FSDP cannot shard a stacked expert weight unevenly along its second dimension
        (["--parallelism.dp", "3", "--training.batch_size", "12"], "model.dim"),
        (
            ["--parallelism.dp", "4", "--parallelism.ep", "2", "--model.expert_hidden_dim", "33"],
            "model.expert_hidden_dim",
        ),
    ],
)
def test_bad_overrides_name_the_key(args, key):
    with pytest.raises(ConfigError, match=key):
        load_config(str(ROOT / DEBUG_CONFIG), args)


@pytest.mark.parametrize(
    "args, hint",
    [
        (["--training.stpes", "5"], "did you mean 'training.steps'? allowed in [training]: steps, stop_at,"),
        (["--training.strategy", "moc"], "did you mean 'checkpoint.strategy'? allowed in [training]: steps,"),
        (["--trainig.steps", "3"], "did you mean 'training.steps'? sections: job, model,"),
        (["--checkpoint.keep_host_stat"], "did you mean 'checkpoint.keep_host_state'? allowed in [checkpoint]"),
    ],
)
def test_unknown_keys_suggest_the_nearest(args, hint):
    with pytest.raises(ConfigError) as e:
        load_config(str(ROOT / DEBUG_CONFIG), args)
    assert hint in str(e.value) and "\n" not in str(e.value)


def test_unknown_names_without_a_near_key_list_the_allowed_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"^unknown config key 'training.zzzzzz' \(allowed in \[training\]: steps"):
        load_config(None, ["--training.zzzzzz", "1"])
    with pytest.raises(ConfigError, match=r"^unknown config section \[trainin\] \(did you mean \[training\]\? allowed"):
        load_config(write(tmp_path, "[trainin]\nsteps = 3\n"))


def test_a_bare_boolean_flag_means_true():
    cfg = load_config(None, ["--checkpoint.keep_host_state"])
    assert cfg.checkpoint.keep_host_state is True
    cfg = load_config(None, ["--metrics.cpu_cost", "--training.steps", "7", "--metrics.progress"])
    assert (cfg.metrics.cpu_cost, cfg.training.steps, cfg.metrics.progress) == (True, 7, True)
    cfg = load_config(None, ["--metrics.tensorboard", "false", "--checkpoint.keep_host_state", "off"])
    assert (cfg.metrics.tensorboard, cfg.checkpoint.keep_host_state) == (False, False)
    with pytest.raises(ConfigError, match=r"^missing value for --training.steps$"):
        load_config(None, ["--training.steps", "--metrics.cpu_cost"])


def _choice_keys() -> list[tuple[str, tuple]]:
    """(key, allowed values) of every config field typed ``Literal[...]``."""
    cfg, out = Config(), []
    for s in dataclasses.fields(cfg):
        section = getattr(cfg, s.name)
        hints = typing.get_type_hints(type(section))
        out += [
            (f"{s.name}.{f.name}", allowed) for f in dataclasses.fields(section) if (allowed := choices(hints[f.name]))
        ]
    return out


CHOICE_KEYS = _choice_keys()


def test_choice_fields_are_literal_types():
    assert {key for key, _ in CHOICE_KEYS} >= {
        "training.mixed_precision",
        "checkpoint.strategy",
        "checkpoint.ordering",
        "checkpoint.background_priority",
        "fault.kill_signal",
        "fault.scope",
        "parallelism.schedule",
    }
    docs = {k.key: k for k in config_keys()}
    for key, allowed in CHOICE_KEYS:
        assert docs[key].type == "str" and all(value in docs[key].doc for value in allowed), key


@pytest.mark.parametrize("key, allowed", CHOICE_KEYS)
def test_every_choice_field_refuses_other_values_from_cli_and_file(tmp_path, key, allowed):
    section, name = key.split(".")
    assert getattr(getattr(Config(), section), name) in allowed
    message = f"^config key '{key}' must be one of {', '.join(allowed)}, got 'nope'$"
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"--{key}", "nope"])
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, f"[{section}]\n{name} = 'nope'\n"))
    with pytest.raises(ConfigError, match=f"^config key '{key}' must be str, got int 3$"):
        load_config(write(tmp_path, f"[{section}]\n{name} = 3\n"))


@pytest.mark.parametrize(
    "args, key",
    [
        (["--job.name", "../escape"], "job.name"),
        (["--job.name", "a/b"], "job.name"),
        (["--job.name", ".hidden"], "job.name"),
        (["--job.name", ""], "job.name"),
        (["--job.seed", "-1"], "job.seed"),
        (["--job.seed", "100000000000000000000000"], "job.seed"),
        (["--training.steps", str(2**63)], "training.steps"),
        (["--training.eps", "0"], "training.eps"),
        (["--training.beta2", "1"], "training.beta2"),
        (
            ["--checkpoint.strategy", "moevement", "--fault.kill", "4:0:validation", "--training.val_every", "3"],
            "fault.kill",
        ),
    ],
)
def test_unsafe_or_meaningless_values_name_the_key(args, key):
    with pytest.raises(ConfigError, match=key):
        load_config(str(ROOT / DEBUG_CONFIG), args)


def test_largest_seed_and_a_directory_name_as_job_name_are_accepted():
    from trainer.config import safe_job_name

    cfg = load_config(str(ROOT / DEBUG_CONFIG), ["--job.seed", str(2**63 - 1), "--job.name", "run-1.v2_a"])
    assert cfg.job.seed == 2**63 - 1 and cfg.job.name == "run-1.v2_a"
    assert safe_job_name("../my ckpt") == "my_ckpt" and safe_job_name("...") == "moe"


def test_empty_and_binary_config_files(tmp_path):
    with pytest.raises(ConfigError, match="sets nothing"):
        load_config(write(tmp_path, "# only a comment\n"))
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(str(binary))


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "absent.toml"))
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[training\n"))


def test_help_lists_every_key_with_type_default_and_doc():
    """`train.py --help` names every key of every config dataclass under its section, with a doc."""
    import dataclasses
    import re
    import subprocess
    import sys

    from trainer.config import Config

    out = subprocess.run(
        [sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    sections = dict(re.findall(r"^  \[(\w+)\]\n((?:    .*\n?)+)", out, re.M))
    cfg = Config()
    assert list(sections) == [f.name for f in dataclasses.fields(cfg)]
    for section in dataclasses.fields(cfg):
        listed = re.findall(r"^    (\w+) \((\w+), default (.*?)\)(?:: (.+))?$", sections[section.name], re.M)
        fields = dataclasses.fields(getattr(cfg, section.name))
        assert [name for name, *_ in listed] == [f.name for f in fields], section.name
        assert all(doc for *_, doc in listed), section.name  # every key has a one-line doc


def test_print_config_reloads_into_the_same_config(tmp_path):
    """`--print-config` prints the resolved config (file + overrides) as TOML that loads back equal."""
    import subprocess
    import sys

    overrides = ["--training.lr", "0.01", "--data.text_field", 'quote" and \\ back', "--fault.timeout_s", "2.5e-3"]
    out = subprocess.run(
        [sys.executable, "train.py", "--config", DEBUG_CONFIG, *overrides, "--print-config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert load_config(write(tmp_path, out)) == load_config(str(ROOT / DEBUG_CONFIG), overrides)


def test_the_key_reference_in_the_docs_is_generated_from_the_dataclasses():
    """docs/configuration.md lists every key as `python -m trainer.config_help` generates it."""
    from trainer.config_help import REFERENCE, generated_block, markdown_tables

    assert generated_block(REFERENCE.read_text()) == markdown_tables(), "run: python -m trainer.config_help"


def test_every_ablation_step_is_a_valid_moevement_config():
    """`benchmarks.ablation`'s variants name real keys and values (a typo would fail after minutes of runs)."""
    from benchmarks.ablation import STEPS
    from benchmarks.variants import variant_flags

    seen = set()
    for _, spec in STEPS:
        strategy, flags = variant_flags(spec)
        cfg = load_config(str(ROOT / DEBUG_CONFIG), ["--checkpoint.strategy", strategy, *flags])
        seen.add((cfg.fault.scope, cfg.fault.frozen_weight_grad, cfg.checkpoint.ordering))
    assert seen == {
        ("global", True, "fixed"),
        ("global", False, "fixed"),
        ("global", False, "count"),
        ("localized", False, "count"),
    }
