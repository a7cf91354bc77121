"""The state digest computed where the state lives equals the digest of the whole state held in one dict,
and is sensitive to every byte, name and shape."""

import torch

from models import build_model
from models.args import ModelArgs
from trainer.checkpoint.state import state_digest, training_plan, training_state_digest


def _trained():
    torch.manual_seed(0)
    model = build_model(ModelArgs(family="gpt", vocab_size=64, dim=16, n_layers=2, n_heads=2, n_routed_experts=4,
                                  expert_hidden_dim=8, top_k=2, max_seq_len=16, n_dense_layers=1))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (1, 16))).sum().backward()
    optimizer.step()
    return model, optimizer


def _whole_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every stored tensor by name, built here without the walk: each expert's slice and step by hand."""
    state = {}
    for name, param in model.named_parameters():
        names = [name]
        if param.dim() == 3:  # a stacked expert weight: layers.<l>.moe.experts.<w>
            prefix, weight = name.rsplit(".", 1)
            names = [f"{prefix}.{e}.{weight}.weight" for e in range(param.shape[0])]
        for key, value in [(None, param), *sorted(optimizer.state[param].items())]:
            for e, stored in enumerate(names):
                tensor = value if len(names) == 1 or value.dim() == 0 else value[e]
                state[stored if key is None else f"optim.{stored}.{key}"] = tensor.detach().clone()
    return state


def test_walked_digest_is_the_whole_state_s_digest():
    model, optimizer = _trained()
    whole = _whole_state(model, optimizer)
    assert "optim.layers.1.moe.experts.3.w2.weight.exp_avg" in whole
    digest = training_state_digest(model, optimizer)
    assert digest == state_digest(whole)
    stored = {name for unit in training_plan(model, optimizer) for name in unit.names}
    assert stored == set(whole)
    changed = dict(whole)
    changed["layers.1.moe.experts.2.w1.weight"] = whole["layers.1.moe.experts.2.w1.weight"].clone()
    changed["layers.1.moe.experts.2.w1.weight"][0, 0] += 1e-6
    renamed = {("x" if n == "norm.weight" else n): t for n, t in whole.items()}
    reshaped = {**whole, "norm.weight": whole["norm.weight"].reshape(2, -1)}
    assert len({digest, state_digest(changed), state_digest(renamed), state_digest(reshaped)}) == 4
