"""Hugging Face interop: the originals' models (built here with ``transformers`` from tiny configs, nothing
downloaded) give the project's logits after ``python -m trainer.hf import``, ``export`` gives back their
tensors, and an exported run scores the same through ``eval.harness``, ``moevement-lm-eval --model
moevement`` and lm-eval's own ``hf`` model."""

from __future__ import annotations

import ast
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

from eval.checkpoint import load_checkpoint
from models import build_model
from models.args import ModelArgs
from models.experts import named_tensors
from tests.helpers import CHILD_ENV, DEBUG_CONFIG, ROOT, final_line, recoveries, run_cli
from trainer.checkpoint.dense import Tensors, save_imported
from trainer.data.tokenizer import ByteTokenizer
from trainer.hf import main
from trainer.hf_tokenizer import byte_level_tokenizer


def _randomise(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _qwen(tmp_path: Path, vocab: int = 300, **overrides) -> tuple[Qwen2MoeForCausalLM, Path]:
    cfg = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        max_position_embeddings=256,
    )
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**(cfg | overrides))).eval()
    _randomise(model, 0)
    model.save_pretrained(tmp_path / "qwen")
    return model, tmp_path / "qwen"


class DeepseekV1MoE(nn.Module):
    """DeepSeek-MoE v1's MoE block as deepseek-moe-16b-base's modeling code computes it: softmax gate over
    ``n_routed_experts``, top-k weights (renormalised only with ``norm_topk_prob``), plus the shared experts
    fused into one MLP of ``n_shared_experts * moe_intermediate_size`` units. Its parameter names are the
    checkpoint's (``gate.weight``, ``experts.<e>.*``, ``shared_experts.*``)."""

    def __init__(self, cfg: LlamaConfig, n_experts: int, top_k: int, moe_dim: int, n_shared: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(cfg.hidden_size, n_experts, bias=False)
        expert_cfg = LlamaConfig(**(cfg.to_dict() | {"intermediate_size": moe_dim}))
        shared_cfg = LlamaConfig(**(cfg.to_dict() | {"intermediate_size": moe_dim * n_shared}))
        self.experts = nn.ModuleList(LlamaMLP(expert_cfg) for _ in range(n_experts))
        self.shared_experts = LlamaMLP(shared_cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = F.linear(flat, self.gate.weight).softmax(dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            for k in range(self.top_k):
                out[t] += weights[t, k] * self.experts[int(ids[t, k])](flat[t])
        return out.view_as(x) + self.shared_experts(x)


DEEPSEEK_CONFIG = {
    "architectures": ["DeepseekForCausalLM"],
    "model_type": "deepseek",
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 6,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
}


def _deepseek_reference(cfg: dict) -> LlamaForCausalLM:
    """A DeepSeek-MoE v1 model from transformers' Llama (the same attention, norms and dense MLP) with
    DeepSeek's MoE block in the layers after ``first_k_dense_replace``."""
    llama_cfg = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"],
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(llama_cfg)
    for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        model.model.layers[i].mlp = DeepseekV1MoE(
            llama_cfg,
            cfg["n_routed_experts"],
            cfg["num_experts_per_tok"],
            cfg["moe_intermediate_size"],
            cfg["n_shared_experts"],
        )
    return model.eval()


def _import(src: Path, dst: Path, *extra: str) -> None:
    assert main(["import", str(src), str(dst), *extra]) == 0


def test_qwen2_moe_import_gives_its_logits_and_export_gives_back_its_tensors(tmp_path):
    ref, src = _qwen(tmp_path)
    _import(src, tmp_path / "ckpt")
    ours = load_checkpoint(tmp_path / "ckpt")
    assert ours.model_args.family == "qwen" and ours.model_args.aux_loss_type == "global"
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(tokens).logits
        torch.testing.assert_close(ours.model(tokens), expected, rtol=0, atol=1e-5)

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    original, exported = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    reloaded = Qwen2MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=0, atol=0)


def test_qwen_global_balance_loss_is_the_reference_s(tmp_path):
    """aux_loss_type = "global": one loss over every MoE layer's tokens, as transformers computes it."""
    ref, src = _qwen(tmp_path, mlp_only_layers=[])
    _import(src, tmp_path / "ckpt")
    model = load_checkpoint(tmp_path / "ckpt").model.train()
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    model(tokens)
    ours = sum(float(m.last_aux_loss) for m in model.moe_layers().values()) / model.args.aux_loss_coef
    with torch.no_grad():
        expected = float(ref(tokens, output_router_logits=True).aux_loss)
    assert ours == pytest.approx(expected, rel=1e-6)
    assert 1.5 < ours < 3.0  # top_k (2) when balanced: not a per-layer sum


def test_deepseek_v1_import_gives_its_logits_and_export_gives_back_its_tensors(tmp_path):
    ref = _deepseek_reference(DEEPSEEK_CONFIG)
    _randomise(ref, 3)
    src = tmp_path / "deepseek"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(DEEPSEEK_CONFIG))
    _import(src, tmp_path / "ckpt")
    ours = load_checkpoint(tmp_path / "ckpt")
    args = ours.model_args
    assert (args.family, args.n_shared_experts, args.n_dense_layers, args.aux_loss_type) == ("deepseek", 2, 1, "seq")
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref(tokens).logits
        torch.testing.assert_close(ours.model(tokens), expected, rtol=0, atol=1e-5)

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    exported = load_file(tmp_path / "out" / "model.safetensors")
    original = load_file(src / "model.safetensors")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    renamed = ("architectures", "rope_theta", "rope_scaling")  # transformers 5 keys RoPE by rope_parameters
    assert {k: config[k] for k in DEEPSEEK_CONFIG if k not in renamed} == {
        k: v for k, v in DEEPSEEK_CONFIG.items() if k not in renamed
    }
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": DEEPSEEK_CONFIG["rope_theta"]}
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_deepseek.DeepseekForCausalLM"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- the deepseek export's own modeling code


@pytest.fixture(autouse=True)
def _modules_cache(tmp_path_factory, monkeypatch):
    """transformers copies remote code into a private modules cache (not ~/.cache), one for the session."""
    import transformers.dynamic_module_utils as dynamic_modules

    cache = tmp_path_factory.getbasetemp() / "hf_modules"
    monkeypatch.setattr(dynamic_modules, "HF_MODULES_CACHE", str(cache))


def _no_network(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the test tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def _deepseek_checkpoint(path: Path, **shape) -> None:
    """A step-0 checkpoint of this project's deepseek-family model, randomised well away from its init (so that
    routing decisions are clear-cut)."""
    torch.manual_seed(0)
    args = ModelArgs(
        **{
            "family": "deepseek",
            "vocab_size": 300,
            "dim": 32,
            "n_layers": 3,
            "n_heads": 4,
            "n_dense_layers": 1,
            "dense_hidden_dim": 48,
            "n_routed_experts": 6,
            "n_shared_experts": 2,
            "expert_hidden_dim": 16,
            "shared_expert_hidden_dim": 16,
            "top_k": 2,
            "max_seq_len": 128,
        }
        | shape
    )
    model = build_model(args)
    _randomise(model, 5)
    tensors = {name: t.detach() for name, t in named_tensors(model)}
    specs = {name: (torch.float32, tuple(t.shape)) for name, t in tensors.items()}
    save_imported(str(path), Tensors(specs, tensors.__getitem__), args, {"source": "test"}, key="CKPT_DIR")


DEEPSEEK_SHAPES = {
    "mha-shared-untied": {},
    "gqa-tied-routed-only": {"n_kv_heads": 2, "tie_embeddings": True, "n_shared_experts": 0, "top_k": 3},
    "all-moe-normalised": {"n_dense_layers": 0, "norm_topk_prob": True, "rope_theta": 500.0},
    # one shared expert twice as wide as a routed one (bench_moe's): deepseek's two of moe_intermediate_size
    "one-wide-shared": {"n_shared_experts": 1, "shared_expert_hidden_dim": 32},
}


@pytest.mark.parametrize("shape", DEEPSEEK_SHAPES.values(), ids=DEEPSEEK_SHAPES.keys())
def test_deepseek_export_loads_offline_with_its_own_code_and_gives_the_project_s_logits(tmp_path, monkeypatch, shape):
    _deepseek_checkpoint(tmp_path / "ckpt", **shape)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    _no_network(monkeypatch)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert type(hf).__name__ == "DeepseekForCausalLM"
    ours = load_checkpoint(tmp_path / "ckpt").model
    tokens = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-5, diff


def test_deepseek_export_generates_with_a_kv_cache_and_left_padding(tmp_path):
    """generate's cached decoding is the project's greedy decoding; a left-padded row gives its unpadded logits."""
    _deepseek_checkpoint(tmp_path / "ckpt", n_kv_heads=2)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    ours = load_checkpoint(tmp_path / "ckpt").model
    prompt = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(7))
    greedy = prompt
    with torch.no_grad():
        for _ in range(10):
            greedy = torch.cat([greedy, ours(greedy)[:, -1:].argmax(-1)], dim=1)
    generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    assert generated.tolist() == greedy.tolist()

    longer = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(8))
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1), longer])
    mask = torch.tensor([[0] * 3 + [1] * 6, [1] * 9])
    with torch.no_grad():
        padded = hf(batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        torch.testing.assert_close(padded[0, 3:], ours(prompt)[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(padded[1], ours(longer)[0], rtol=0, atol=1e-5)


def test_deepseek_export_code_is_self_contained(tmp_path):
    """The shipped code imports only torch, transformers and itself: nothing of this repository."""
    _deepseek_checkpoint(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    shipped = {f"{ref.split('.')[0]}.py" for ref in config["auto_map"].values()}
    assert shipped == {"configuration_deepseek.py", "modeling_deepseek.py"}
    for name in shipped:
        tree = ast.parse((tmp_path / "out" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {"." + node.module if node.level else node.module.split(".")[0]}
            else:
                continue
            assert roots <= {"__future__", "torch", "transformers", ".configuration_deepseek"}, (name, roots)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"model_type": "deepseek_v2", "kv_lora_rank": 512}, "model_type 'deepseek_v2' (MLA attention"),
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_features_are_one_line(tmp_path, capsys, change, named):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(DEEPSEEK_CONFIG | change))
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: config.json: ") and named in err and "\n" not in err
    assert not (tmp_path / "ckpt").exists()


def test_pickled_weights_are_refused_unread(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(DEEPSEEK_CONFIG))
    (src / "pytorch_model.bin").write_bytes(b"not read")
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 2
    assert "pickled weights" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_symlinked_file_is_refused_unfollowed(tmp_path, capsys, name):
    """As the trainer's own checkpoints: a file of the import that is a symlink is never followed."""
    _, src = _qwen(tmp_path)
    (src / name).rename(tmp_path / name)
    (src / name).symlink_to(tmp_path / name)
    capsys.readouterr()  # transformers' own output while it saved the model
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {src / name}: is a symlink; refused, never followed") and "\n" not in err, err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, capsys, value):
    """One NaN (or infinity) in an expert's weight: one line naming the file and the tensor, and nothing of
    the checkpoint left (the tensors before it were written already)."""
    _, src = _qwen(tmp_path)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    tensors[name][0, 3] = value
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # transformers' own output while it saved the model
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"error: {src / 'model.safetensors'}: tensor {name} holds 1 non-finite value(s) (NaN or infinity); refused"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen"]  # no checkpoint, no temporary


def test_exported_byte_tokenizer_is_the_trainer_s(tmp_path):
    text = "Question: héllo wörld\n\tdone 🙂"
    assert byte_level_tokenizer().encode(text).ids == ByteTokenizer().encode(text)
    from transformers import AutoTokenizer

    _, src = _qwen(tmp_path)
    _import(src, tmp_path / "ckpt")
    main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(text)
    assert hf_tok.eos_token_id == ByteTokenizer.eos_id


# ---------------------------------------------------------------- the user's path, end to end


def _lm_eval(n: int, out: Path, *model: str) -> dict:
    """``moevement-lm-eval`` as the installed command runs it (``python -m eval.lm_eval_cli`` in the checkout;
    tests/test_install.py runs the installed command) on the first ``n`` items of the project's ``piqa_local``
    task (../shared/data/piqa)."""
    cmd = [sys.executable, "-m", "eval.lm_eval_cli", *model, "--tasks", "piqa_local", "--limit", str(n)]
    cmd += ["--output_path", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (results,) = out.rglob("results_*.json")
    scores = json.loads(results.read_text())["results"]["piqa_local"]
    return {"acc": scores["acc,none"], "acc_norm": scores["acc_norm,none"]}


@pytest.mark.slow
def test_import_train_with_a_failure_export_and_score_with_lm_eval(tmp_path):
    """README's path: import a Qwen-MoE, train it under a failure (bit-exact against a fault-free run),
    export it; lm-eval's ``hf`` model, ``moevement-lm-eval --model moevement`` and ``eval.harness`` agree."""
    _, src = _qwen(tmp_path, vocab=260, mlp_only_layers=[], num_key_value_heads=4, max_position_embeddings=1024)
    config = tmp_path / "qwen.toml"
    _import(src, tmp_path / "imported", "--config-out", str(config), "--base-config", DEBUG_CONFIG)
    common = ("--config", str(config), "--parallelism.dp", "2", "--training.steps", "6", "--training.val_every", "0")
    ft = ("--checkpoint.strategy", "moevement", "--checkpoint.window", "2")
    clean = run_cli(*common, *ft, nproc=2)
    failed = run_cli(*common, *ft, "--fault.at", "5:1", "--checkpoint.save_final", str(tmp_path / "trained"), nproc=2)
    assert "holds imported weights" in failed.stdout and any(r.step == 5 for r in recoveries(failed.stdout))
    assert final_line(failed.stdout) == final_line(clean.stdout)
    assert main(["export", str(tmp_path / "trained"), str(tmp_path / "hf")]) == 0

    n = 40
    harness = subprocess.run(
        [
            *(sys.executable, "-m", "eval.harness", "--checkpoint", str(tmp_path / "trained"), "--limit", str(n)),
            *("--output", str(tmp_path / "eval_results.json")),
        ],
        cwd=ROOT,
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert harness.returncode == 0, harness.stderr
    acc, acc_norm = map(float, re.search(r"task=piqa_local acc=(\S+) acc_norm=(\S+) n=40", harness.stdout).groups())
    # lm-eval's default device and --batch_size from its command line (no CUDA here: the CPU, with a warning)
    model_args = f"checkpoint={tmp_path / 'trained'},batch_size=16"  # also given below: no "multiple values"
    ours = _lm_eval(n, tmp_path / "lm1", "--model", "moevement", "--model_args", model_args, "--batch_size", "4")
    hf = _lm_eval(
        n,
        tmp_path / "lm2",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={tmp_path / 'hf'},dtype=float32",
        "--device",
        "cpu",
        "--batch_size",
        "8",
    )
    assert ours == hf == {"acc": pytest.approx(acc, abs=1e-4), "acc_norm": pytest.approx(acc_norm, abs=1e-4)}


# config.json of the released models (deepseek-ai/deepseek-moe-16b-base, Qwen/Qwen1.5-MoE-A2.7B), keys that
# decide the model
RELEASED = {
    "deepseek_moe_16b_hf": DEEPSEEK_CONFIG
    | {
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "max_position_embeddings": 4096,
    },
    "qwen_moe_14b_hf": {
        "model_type": "qwen2_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_continued_pretraining_configs_match_the_released_models(name):
    """The `_hf` configs' [model] is what importing the released model gives (a checkpoint of another shape
    would be refused by --checkpoint.load)."""
    from models.hf_mapping import args_from_hf_config
    from trainer.config import load_config

    cfg = load_config(str(ROOT / "train_configs" / f"{name}.toml"))
    assert cfg.model == args_from_hf_config(RELEASED[name])
