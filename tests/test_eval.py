"""lm-eval harness over train.py checkpoints: adapter scores, tasks, CLI (eval/)."""

import os

os.environ["HF_DATASETS_OFFLINE"] = "1"  # nothing may download: set before datasets is imported
os.environ["HF_HUB_OFFLINE"] = "1"

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from eval import harness
from eval.checkpoint import load_checkpoint
from eval.errors import EvalError
from eval.lm_eval_cli import split_tasks, with_tasks
from eval.lm_eval_tasks.local_data import DEFAULT_PIQA_DIR, HELLASWAG_FILE_ENV, HELLASWAG_SOURCE, PIQA_DIR_ENV
from eval.model import GENERATE_UNSUPPORTED, MoEvementLM, requests_from_pairs, score_windows
from eval.tasks import TASK_DIR, load_tasks
from tests.helpers import CHILD_ENV, DEBUG_CONFIG, ROOT, run_cli

NO_HELLASWAG = (
    f"hellaswag_local ({TASK_DIR / 'hellaswag_local.yaml'}): no HellaSwag file: set {HELLASWAG_FILE_ENV}=FILE (or "
    "eval.harness --hellaswag-file FILE), a JSONL in the original HellaSwag format (ctx_a, ctx_b, activity_label, "
    f"endings, label), e.g. {HELLASWAG_SOURCE}"
)
LINE = re.compile(r"^task=(\w+) acc=([0-9.]+) acc_norm=([0-9.]+) n=(\d+)$", re.M)
PIQA_LABELS = DEFAULT_PIQA_DIR / "valid-labels.lst"

# A made-up toy fixture in HellaSwag's file format -- NOT items of the benchmark.
TOY_HELLASWAG = [
    {
        "ind": 0,
        "activity_label": "Toy fixture",
        "ctx_a": "A cat sits on a mat.",
        "ctx_b": "it",
        "endings": ["purrs quietly [title] and sleeps.", "flies to the moon.", "writes a novel.", "becomes a teapot."],
        "label": 0,
    },
    {
        "ind": 1,
        "activity_label": "Toy fixture",
        "ctx_a": "The kettle boils.",
        "ctx_b": "someone",
        "endings": ["pours the water into a cup.", "eats the kettle.", "swims in it.", "paints it blue."],
        "label": "0",
    },
    {
        "ind": 2,
        "activity_label": "Toy fixture",
        "ctx_a": "It starts to rain.",
        "ctx_b": "people",
        "endings": ["dance on the sun.", "open their umbrellas.", "freeze into ice.", "turn into birds."],
        "label": 1,
    },
    {
        "ind": 3,
        "activity_label": "Toy fixture",
        "ctx_a": "The baker kneads dough.",
        "ctx_b": "then she",
        "endings": ["bakes it into bread.", "mails it to Mars.", "plays chess with it.", "sings to the oven."],
        "label": 0,
    },
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    ckpt = str(tmp_path_factory.mktemp("eval") / "ckpt")
    run_cli(
        "--config",
        DEBUG_CONFIG,
        "--training.steps",
        "2",
        "--metrics.tensorboard",
        "false",
        "--training.val_every",
        "0",
        "--checkpoint.save_final",
        ckpt,
    )
    return ckpt


@pytest.fixture(scope="module")
def lm(checkpoint) -> MoEvementLM:
    return MoEvementLM(checkpoint=checkpoint, batch_size=4)


@pytest.fixture
def toy_hellaswag(tmp_path) -> Path:
    path = tmp_path / "toy_hellaswag.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in TOY_HELLASWAG))
    return path


def direct_loglikelihood(model, ids: list[int], n_pred: int) -> tuple[float, bool]:
    """Reference: one forward pass of the whole sequence, log_softmax by hand."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    logprobs = F.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(ids[len(ids) - n_pred :])
    picked = logprobs[len(ids) - n_pred - 1 : len(ids) - 1]
    return (float(picked.gather(1, targets[:, None]).double().sum()), bool((picked.argmax(-1) == targets).all()))


PAIRS = [
    ("Question: How do I boil an egg?\nAnswer:", " Put it in boiling water for eight minutes."),
    ("The capital of France is ", "Paris."),  # trailing space moves to the continuation
    ("", "A whole document scored from the end-of-sequence token."),
    ("Short", " x"),
]


def test_loglikelihood_equals_direct_forward(lm):
    eos = lm.tokenizer.eos_id
    expected = []
    for context, continuation in PAIRS:
        ctx = lm.tokenizer.encode(context.rstrip()) if context else [eos]
        spaces = context[len(context.rstrip()) :]
        cont = lm.tokenizer.encode(spaces + continuation)
        expected.append(direct_loglikelihood(lm.model, ctx + cont, len(cont)))
    batched = lm.loglikelihood(requests_from_pairs(PAIRS))
    one_by_one = MoEvementLM(model=lm.model, tokenizer=lm.tokenizer, batch_size=1).loglikelihood(
        requests_from_pairs(PAIRS)
    )
    assert one_by_one == expected  # same forward, same arithmetic: bit-identical
    for (got, greedy), (want, want_greedy) in zip(batched, expected):
        assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (got, want)  # padded batch of 4
        assert greedy == want_greedy
    assert all(ll < 0 for ll, _ in batched)


def test_long_inputs_use_rolling_windows(lm):
    """Past max_length: lm-eval's rolling windows (each target once, full left context)."""
    small = MoEvementLM(model=lm.model, tokenizer=lm.tokenizer, batch_size=3, max_length=16)
    text = "Windows of sixteen byte tokens each cover this sentence, and the last one is partial."
    ids = lm.tokenizer.encode(text)
    want = 0.0
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(ids, lm.tokenizer.eos_id, 16, 1)):
        window = (ctx + cont)[-17:]
        want += direct_loglikelihood(lm.model, window, len(cont))[0]
    [got] = small.loglikelihood_rolling(requests_from_pairs([(text,)]))
    assert abs(got - want) <= 1e-5 * abs(want)
    # A continuation longer than the window: same windows (eos context, then the text).
    [(got_ll, _)] = small.loglikelihood(requests_from_pairs([("", text)]))
    assert abs(got_ll - want) <= 1e-5 * abs(want)
    assert score_windows(5, 4, 16) == [(0, 4, 4)]
    assert score_windows(40, 30, 16) == [(9, 25, 16), (23, 39, 14)]


def test_generate_until_is_not_supported(lm):
    with pytest.raises(NotImplementedError, match="not supported"):
        lm.generate_until(requests_from_pairs([("Once upon a time", {"until": ["\n"]})]))
    assert "generate_until" in GENERATE_UNSUPPORTED


def test_checkpoint_loads_trained_weights_single_process(checkpoint, lm):
    loaded = load_checkpoint(checkpoint)
    # train.py records data.tokenizer in meta.json, so evaluation picks the training tokenizer
    assert loaded.step == 2 and loaded.tokenizer_source == "meta.json" and not loaded.model.training
    assert not torch.distributed.is_initialized()
    # Trained weights, not the initialisation: they differ from a fresh build with the job's seed.
    from models import build_model

    torch.manual_seed(0)
    fresh = build_model(loaded.model_args)
    name = "layers.1.moe.experts.w1"  # every expert's, stacked
    assert not torch.equal(fresh.state_dict()[name][3], loaded.model.state_dict()[name][3])
    assert torch.equal(lm.model.state_dict()[name], loaded.model.state_dict()[name])
    # --config picks the tokenizer and checks the shape against the checkpoint.
    assert load_checkpoint(checkpoint, config=DEBUG_CONFIG).tokenizer_source == "config"


def test_piqa_task_sees_every_item_with_its_label():
    tasks, errors = load_tasks(["piqa_local"])
    assert not errors
    task = tasks["piqa_local"]
    docs = task.validation_docs()
    labels = [int(x) for x in PIQA_LABELS.read_text().split()]
    assert len(docs) == len(labels) == 1838
    for i in (0, 1, 2, 917, 1836, 1837):
        assert docs[i]["label"] == labels[i]
        assert task.doc_to_target(docs[i]) == labels[i]
    doc = docs[0]
    assert task.doc_to_text(doc) == f"Question: {doc['goal']}\nAnswer:"
    assert task.doc_to_choice(doc) == [doc["sol1"], doc["sol2"]]
    assert not task.has_training_docs()


def _task_yaml(path: Path) -> dict:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")
    return yaml.load(path.read_text(), Loader=Loader)


# what the local task files change of lm-eval's: the name and where the data comes from
LOCAL_KEYS = {"task", "tag", "dataset_path", "dataset_name", "custom_dataset", "training_split"}


@pytest.mark.parametrize("name", ["piqa", "hellaswag"])
def test_task_files_are_the_installed_lm_eval_tasks_over_local_data(name):
    import lm_eval

    installed = _task_yaml(Path(lm_eval.__file__).parent / "tasks" / name / f"{name}.yaml")
    ours = _task_yaml(TASK_DIR / f"{name}_local.yaml")
    assert ours["task"] == f"{name}_local" and ours["training_split"] is None  # zero-shot: no training split
    assert ours["custom_dataset"] == f"!function local_data.{name}_dataset"
    if name == "hellaswag":  # lm-eval's own preprocessing, imported from lm-eval
        assert installed.pop("process_docs") == "!function utils.process_docs"
        assert ours.pop("process_docs") == "!function lm_eval.tasks.hellaswag.utils.process_docs"
    strip = lambda cfg: {k: v for k, v in cfg.items() if k not in LOCAL_KEYS}  # noqa: E731
    assert strip(ours) == strip(installed)


def test_hellaswag_fixture_end_to_end(checkpoint, toy_hellaswag, tmp_path, capsys):
    out = tmp_path / "results.json"
    rc = harness.main(
        [
            "--checkpoint",
            checkpoint,
            "--tasks",
            "piqa_local,hellaswag_local",
            "--limit",
            "3",
            "--hellaswag-file",
            str(toy_hellaswag),
            "--batch-size",
            "8",
            "--output",
            str(out),
        ]
    )
    stdout = capsys.readouterr().out
    assert rc == 0
    lines = LINE.findall(stdout)
    assert [(t, int(n)) for t, _, _, n in lines] == [("piqa_local", 3), ("hellaswag_local", 3)], stdout
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"piqa_local", "hellaswag_local"}
    assert results["n-samples"]["hellaswag_local"] == {"original": 4, "effective": 3}
    acc = results["results"]["hellaswag_local"]["acc,none"]
    assert f"acc={acc:.4f}" in stdout
    task = load_tasks(["hellaswag_local"], hellaswag_file=toy_hellaswag)[0]["hellaswag_local"]
    doc = task.validation_docs()[0]  # lm-eval's preprocessing: "[title]" -> ". ", ctx_b capitalised
    assert task.doc_to_text(doc) == "Toy fixture: A cat sits on a mat. It"
    assert task.doc_to_choice(doc)[0] == "purrs quietly. and sleeps."
    assert [task.doc_to_target(d) for d in task.validation_docs()] == [0, 0, 1, 0]


def test_default_output_is_outside_the_checkpoint(checkpoint, tmp_path, monkeypatch, capsys):
    """The results go to outputs/eval/<checkpoint name>/<timestamp>/ under the current directory, a new folder
    each time; the checkpoint is left as it was, so --checkpoint.save_final to it is still accepted."""
    from trainer.checkpoint.dense import check_save_target

    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in Path(checkpoint).iterdir())
    for _ in range(2):
        assert harness.main(["--checkpoint", checkpoint, "--tasks", "piqa_local", "--limit", "2"]) == 0
    captured = capsys.readouterr()
    assert LINE.search(captured.out)
    written = sorted((tmp_path / "outputs" / "eval" / Path(checkpoint).name).glob(f"*/{harness.RESULTS_FILE}"))
    assert len(written) == 2 and f"results -> {written[0].relative_to(tmp_path)}" in captured.err
    assert json.loads(written[0].read_text())["n-samples"]["piqa_local"]["effective"] == 2
    assert sorted(p.name for p in Path(checkpoint).iterdir()) == before
    check_save_target(checkpoint)  # raises CheckpointError for a directory holding anything but a checkpoint
    with pytest.raises(SystemExit):
        harness.parse_args(["--help"])
    assert "outputs/eval/<checkpoint name>/<UTC timestamp>/eval_results.json" in " ".join(
        capsys.readouterr().out.split()
    )


def test_unwritable_output_is_one_line(checkpoint, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    argv = ["--checkpoint", checkpoint, "--limit", "1", "--output", str(tmp_path / "file" / "r.json")]
    assert harness.main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: --output: cannot write ") and "file/r.json" in errors[0]


def _error(capsys, *argv) -> str:
    assert harness.main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_one_line_errors(checkpoint, tmp_path, toy_hellaswag, capsys):
    assert "no such directory" in _error(capsys, "--checkpoint", str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    assert "meta.json" in _error(capsys, "--checkpoint", str(tmp_path / "empty"))
    assert "unknown task 'mmlu'" in _error(capsys, "--checkpoint", checkpoint, "--tasks", "piqa_local,mmlu")
    assert "valid.jsonl" in _error(capsys, "--checkpoint", checkpoint, "--piqa-dir", str(tmp_path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ctx_a": "x", "endings": ["a", "b"], "label": 0}) + "\n")
    assert "missing field(s)" in _error(
        capsys, "--checkpoint", checkpoint, "--tasks", "hellaswag_local", "--hellaswag-file", str(bad)
    )
    assert "tokenizer" in _error(capsys, "--checkpoint", checkpoint, "--tokenizer", str(tmp_path / "none.json"))


def test_truncated_checkpoint_is_one_line_error(checkpoint, tmp_path, capsys):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    shard = copy / "model-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert "checksum mismatch" in _error(capsys, "--checkpoint", str(copy))


def test_missing_task_data_is_one_line_and_the_other_tasks_still_run(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(HELLASWAG_FILE_ENV, raising=False)
    out = tmp_path / "results.json"
    argv = ["--checkpoint", checkpoint, "--tasks", "hellaswag_local,piqa_local", "--limit", "2", "--output", str(out)]
    assert harness.main(argv) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {NO_HELLASWAG}"]
    assert [(t, int(n)) for t, _, _, n in LINE.findall(captured.out)] == [("piqa_local", 2)]
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"piqa_local"} and results["moevement"]["failed_tasks"] == ["hellaswag_local"]
    # the environment variable names the file as --hellaswag-file does
    monkeypatch.setenv(HELLASWAG_FILE_ENV, str(tmp_path / "absent.jsonl"))
    assert "absent.jsonl' not found" in _error(capsys, "--checkpoint", checkpoint, "--tasks", "hellaswag_local")


def test_loads_through_lm_eval_registry(checkpoint):
    from lm_eval.api.registry import get_model

    cls = get_model("moevement")
    assert cls is MoEvementLM
    lm = cls.create_from_arg_string(f"checkpoint={checkpoint},batch_size=2")
    assert lm.batch_size == 2 and lm.max_length == 512
    with pytest.raises(EvalError, match="batch_size"):
        cls.create_from_arg_string(f"checkpoint={checkpoint},batch_size=0")


@pytest.mark.slow
def test_torchrun_two_ranks_match_single_process(checkpoint, tmp_path):
    """Documents split across 2 gloo ranks, metrics gathered on rank 0: same scores as 1 process."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    scores = {}
    for nproc in (1, 2):
        out = tmp_path / f"r{nproc}.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "eval.harness",
            "--checkpoint",
            checkpoint,
            "--tasks",
            "piqa_local",
            "--limit",
            "10",
            "--output",
            str(out),
        ]
        proc = subprocess.run(
            cmd, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        assert len(LINE.findall(proc.stdout)) == 1, proc.stdout
        assert "\r" not in proc.stderr and "it/s" not in proc.stderr, proc.stderr  # no bars in a redirected log
        results = json.loads(out.read_text())
        scores[nproc] = (
            results["results"]["piqa_local"]["acc,none"],
            results["results"]["piqa_local"]["acc_norm,none"],
            results["n-samples"]["piqa_local"]["effective"],
        )
    assert scores[1] == scores[2]


def test_progress_counts_items_not_requests():
    """A PIQA item is 2 requests, a HellaSwag item 4: the bar advances when an item's last request is scored."""
    from eval.model import ItemProgress

    requests = [("piqa", 0), ("piqa", 0), ("hellaswag", 0), ("piqa", 1), ("hellaswag", 0), ("piqa", 1)]
    progress = ItemProgress(requests, "eval hellaswag + piqa", disable=True)
    assert progress.total == 3
    for n in (0, 1, 2, 3):
        progress.scored(n)
    assert progress.done == 1  # piqa 0 done; hellaswag 0 and piqa 1 have a request left
    progress.scored(5)
    progress.scored(4)
    assert progress.done == 3


def _tiny_hf_model(tmp_path: Path) -> Path:
    """A tiny random Qwen-MoE with the byte-level tokenizer, in Hugging Face's layout (made here, not downloaded)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from trainer.hf import main as hf_main

    torch.manual_seed(0)
    shape = dict(vocab_size=260, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
    shape |= dict(num_experts=4, num_experts_per_tok=2, max_position_embeddings=1024)
    Qwen2MoeForCausalLM(Qwen2MoeConfig(**shape)).save_pretrained(tmp_path / "src")
    assert hf_main(["import", str(tmp_path / "src"), str(tmp_path / "ckpt")]) == 0
    assert hf_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    return tmp_path / "hf"


def _piqa_accuracy_by_hand(hf_dir: Path, n: int) -> tuple[float, float]:
    """acc and acc_norm of the first ``n`` PIQA items: lm-eval's piqa prompt scored by a plain forward pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(hf_dir).eval(), AutoTokenizer.from_pretrained(hf_dir)
    rows = [json.loads(line) for line in (DEFAULT_PIQA_DIR / "valid.jsonl").read_text().splitlines()[:n]]
    labels = [int(x) for x in PIQA_LABELS.read_text().split()[:n]]
    hits = hits_norm = 0
    for row, label in zip(rows, labels):
        ctx = tok(f"Question: {row['goal']}\nAnswer:", add_special_tokens=False)["input_ids"]
        lls = []
        for sol in (row["sol1"], row["sol2"]):
            cont = tok(" " + sol, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ctx + cont])).logits[0]
            logprobs = F.log_softmax(logits.float(), dim=-1)[len(ctx) - 1 : -1]
            lls.append(float(logprobs.gather(1, torch.tensor(cont)[:, None]).sum()))
        hits += max((0, 1), key=lambda i: lls[i]) == label
        norm = [lls[0] / len(row["sol1"]), lls[1] / len(row["sol2"])]
        hits_norm += max((0, 1), key=lambda i: norm[i]) == label
    return hits / n, hits_norm / n


@pytest.mark.slow
def test_lm_eval_cli_scores_the_local_piqa_task_file(tmp_path):
    """lm-eval's own command line, ``--include_path eval/lm_eval_tasks --tasks piqa_local``, offline, scores
    a Hugging Face model on the first items of ../shared/data/piqa as lm-eval's piqa prompt does."""
    hf_dir, n = _tiny_hf_model(tmp_path), 8
    lm_eval = Path(sys.executable).parent / "lm_eval"
    cmd = [str(lm_eval), "--model", "hf", "--model_args", f"pretrained={hf_dir},dtype=float32", "--device", "cpu"]
    cmd += ["--include_path", str(TASK_DIR), "--tasks", "piqa_local", "--limit", str(n), "--batch_size", "1"]
    cmd += ["--output_path", str(tmp_path / "out")]
    env = {k: v for k, v in CHILD_ENV.items() if k != PIQA_DIR_ENV}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "piqa_local" in proc.stdout  # lm-eval's results table
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["n-samples"]["piqa_local"] == {"original": 1838, "effective": n}
    acc, acc_norm = _piqa_accuracy_by_hand(hf_dir, n)
    scores = results["results"]["piqa_local"]
    assert (scores["acc,none"], scores["acc_norm,none"]) == (pytest.approx(acc), pytest.approx(acc_norm))


@pytest.mark.slow
def test_moevement_lm_eval_runs_the_tasks_whose_data_is_there(checkpoint, tmp_path):
    """``moevement-lm-eval`` includes the task files itself; a task without data is one line, the rest run."""
    env = {k: v for k, v in CHILD_ENV.items() if k != HELLASWAG_FILE_ENV}
    cmd = [sys.executable, "-m", "eval.lm_eval_cli", "--model", "moevement", "--model_args", f"checkpoint={checkpoint}"]
    cmd += ["--tasks", "hellaswag_local,piqa_local", "--limit", "3", "--batch_size", "4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {NO_HELLASWAG}"], proc.stderr
    assert "Traceback" not in proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|piqa_local")]
    assert len(rows) == 1 and "acc" in rows[0], proc.stdout  # lm-eval's results table


def test_lm_eval_s_own_task_loading_stops_at_missing_data_in_one_line(monkeypatch, capsys, tmp_path):
    """What ``lm_eval --include_path eval/lm_eval_tasks`` runs (lm-eval's TaskManager, no project loader between):
    a task's missing data is one line naming the project's task file, then exit status 2; no traceback."""
    from lm_eval.tasks import TaskManager

    monkeypatch.delenv(HELLASWAG_FILE_ENV, raising=False)
    monkeypatch.setenv(PIQA_DIR_ENV, str(tmp_path))
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    piqa = f"piqa_local ({TASK_DIR / 'piqa_local.yaml'}): data file '{tmp_path / 'valid.jsonl'}' not found"
    for task, line in (("hellaswag_local", NO_HELLASWAG), ("piqa_local", piqa)):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            manager.load([task])
        assert stopped.value.code == 2
        errors = [text for text in capsys.readouterr().err.splitlines() if text.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {line}"), errors


@pytest.mark.slow
def test_lm_eval_s_own_command_line_stops_at_missing_hellaswag_data_in_one_line(tmp_path):
    lm_eval = Path(sys.executable).parent / "lm_eval"
    cmd = [str(lm_eval), "--model", "dummy", "--include_path", str(TASK_DIR), "--tasks", "hellaswag_local"]
    env = {k: v for k, v in CHILD_ENV.items() if k != HELLASWAG_FILE_ENV}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [f"error: {NO_HELLASWAG}"]


def test_lm_eval_cli_task_arguments():
    assert split_tasks(["--model", "hf", "--tasks", "a,b", "c", "--limit", "3"]) == (
        ["--model", "hf", "--limit", "3"],
        ["a", "b", "c"],
    )
    assert split_tasks(["run", "-t", "a", "--tasks=b,c"]) == (["run"], ["a", "b", "c"])
    assert split_tasks(["ls", "tasks"]) == (["ls", "tasks"], [])
    assert with_tasks(["--limit", "3"], ["a", "b"]) == ["--limit", "3", "--tasks", "a,b"]
    assert with_tasks(["ls"], []) == ["ls"]
