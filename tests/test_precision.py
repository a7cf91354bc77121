"""bf16 products through SGEMM (parallelisms.precision): numerics, gradients, frozen weights."""

import torch
import torch.nn.functional as F
from torch import nn

from parallelisms.precision import use_fp32_gemm


def _pair(bias: bool):
    torch.manual_seed(0)
    ref = nn.Linear(16, 8, bias=bias).to(torch.bfloat16)
    patched = nn.Linear(16, 8, bias=bias).to(torch.bfloat16)
    patched.load_state_dict(ref.state_dict())
    assert use_fp32_gemm(patched) == 1
    return ref, patched


def test_forward_and_gradients_are_sgemm_of_the_bf16_operands_rounded_to_bf16():
    _, lin = _pair(bias=True)
    x = torch.randn(2, 5, 16).to(torch.bfloat16).requires_grad_()
    out = lin(x)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16)
    assert torch.equal(out, expected)
    g = torch.randn_like(out)
    out.backward(g)
    gf = g.float().reshape(-1, 8)
    assert torch.equal(x.grad, (g.float() @ lin.weight.float()).to(torch.bfloat16))
    assert torch.equal(lin.weight.grad, (gf.t() @ x.detach().float().reshape(-1, 16)).to(torch.bfloat16))
    assert torch.equal(lin.bias.grad, gf.sum(0).to(torch.bfloat16))


def test_close_to_the_native_bf16_kernel():
    ref, lin = _pair(bias=False)
    x = torch.randn(4, 16).to(torch.bfloat16)
    assert torch.allclose(lin(x).float(), ref(x).float(), rtol=2e-2, atol=2e-2)


def test_frozen_weight_gets_no_gradient_and_input_gradient_is_unchanged():
    _, lin = _pair(bias=False)
    x = torch.randn(3, 16).to(torch.bfloat16).requires_grad_()
    lin(x).sum().backward()
    trained = x.grad.clone()
    x.grad = None
    lin.weight.grad = None
    lin.weight.requires_grad_(False)
    lin(x).sum().backward()
    assert lin.weight.grad is None
    assert torch.equal(x.grad, trained)


def test_fp32_inputs_take_the_ordinary_path():
    lin = nn.Linear(4, 2)
    use_fp32_gemm(lin)
    x = torch.randn(3, 4)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
