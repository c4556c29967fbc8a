"""Real models run unmodified on ``remote_accelerator`` and give eager's results (issue 3, item 6).

Every model is built on the CPU from a tiny config with a fixed seed (random weights, nothing is
downloaded), deep-copied, and the copy is moved with ``.to("remote_accelerator")``; the same
program then runs on both. Eager CPU is the oracle:

- forward (eval mode, ``no_grad``): every output tensor equal within float32 tolerance;
- one training step (train mode, dropout p=0, loss, ``backward()``, ``AdamW.step()``): the loss,
  every gradient, every updated parameter and every buffer (BatchNorm running statistics);
- greedy ``generate()`` of 8 new tokens (GPT-2, Llama, Mixtral): the same tokens.

Each device-side run reports ``genie.stats()`` counters (forced materializations, nodes executed)
through the ``counts`` fixture (tests/integration/conftest.py): printed with ``-s`` and in the
terminal summary, quoted in docs/models.md.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import genie
from genie.device import real_device

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

D = "remote_accelerator"
VOCAB = 96
BATCH, SEQ = 2, 8


# --- the models ----------------------------------------------------------------------------------

def _gpt2(attn: str) -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4, initializer_range=0.2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(cfg)  # lm_head is tied to wte


def _bert(attn: str) -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0, attn_implementation=attn)
    return transformers.BertForMaskedLM(cfg)  # the MLM decoder is tied to the word embeddings


def _llama(attn: str) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
        initializer_range=0.2, bos_token_id=1, eos_token_id=0, pad_token_id=0,
        attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg)  # grouped-query attention, RoPE, RMSNorm, SiLU


def _mixtral(attn: str) -> nn.Module:
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
        initializer_range=0.2, bos_token_id=1, eos_token_id=0, pad_token_id=0,
        attn_implementation=attn)
    # mixture of experts: tokens sorted by expert, counted with an integral histc (a kernel only
    # CUDA has: genie.portable records CUDA's arithmetic), grouped matmuls over the groups
    return transformers.MixtralForCausalLM(cfg)


def _transformer_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2)


def _cnn() -> nn.Module:
    m = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 3 * 3, 10))
    for bn in (m[1], m[5]):  # non-trivial statistics and affine parameters
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        nn.init.uniform_(bn.weight, 0.5, 1.5)
        nn.init.uniform_(bn.bias, -0.5, 0.5)
    return m


def _token_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -2:] = 0  # right padding in the second sequence exercises the attention masks
    return {"input_ids": ids, "attention_mask": mask}


def _lm_loss(model: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
    labels = x["input_ids"].masked_fill(x["attention_mask"] == 0, -100)
    return model(**x, labels=labels).loss


def _mse_loss(model: nn.Module, x: dict[str, torch.Tensor]) -> torch.Tensor:
    out = _first(model(**x))
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    return nn.functional.mse_loss(out, target)


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, torch.Tensor]]
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    forward_kwargs: tuple[tuple[str, Any], ...] = ()


_HF = {"gpt2": _gpt2, "bert": _bert, "llama": _llama, "mixtral": _mixtral}
CASES: dict[str, Case] = {
    f"{name}-{attn}": Case(lambda b=build, a=attn: b(a), _token_inputs, _lm_loss,
                           (("use_cache", False),) if name != "bert" else ())
    for name, build in _HF.items() for attn in ("eager", "sdpa")
}
CASES.update({
    "transformer_encoder": Case(_transformer_encoder,
                                lambda: {"src": torch.randn(BATCH, SEQ, 64)}, _mse_loss),
    "lstm": Case(lambda: nn.LSTM(16, 32, num_layers=2, batch_first=True, bidirectional=True),
                 lambda: {"input": torch.randn(BATCH, 5, 16)}, _mse_loss),
    "gru": Case(lambda: nn.GRU(16, 32, num_layers=2, batch_first=True),
                lambda: {"input": torch.randn(BATCH, 5, 16)}, _mse_loss),
    "cnn": Case(_cnn, lambda: {"input": torch.randn(4, 3, 16, 16)}, _mse_loss),
})


# --- helpers -------------------------------------------------------------------------------------

def _first(out: Any) -> torch.Tensor:
    """The main output: logits / last hidden state / the RNN's output sequence."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):  # transformers' ModelOutput
        return next(v for v in out.values() if isinstance(v, torch.Tensor))
    return _first(out[0])


def _tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) model output, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _to(x: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in x.items()}


def _pair(case: Case) -> tuple[nn.Module, nn.Module]:
    """(eager model, the same model moved to the device): identical weights and buffers."""
    torch.manual_seed(0)
    model = case.build()
    return model, copy.deepcopy(model).to(D)


# The oracle is eager on the CPU (eager CUDA backward cannot run in a process where genie is
# imported: pytorch/pytorch#161129). On a CUDA real device the kernels are CUDA's (other reduction
# orders), and an AdamW step turns gradient rounding into ~1e-5 parameter differences.
_TOL = {} if real_device(0).type == "cpu" else {"rtol": 1e-3, "atol": 1e-4}


def _close(got: torch.Tensor | None, expected: torch.Tensor | None, what: str) -> None:
    if expected is None:
        assert got is None, f"{what}: eager has None, genie has a tensor"
        return
    assert got is not None, f"{what}: genie has None, eager has a tensor"
    assert got.device.type == D, f"{what} is on {got.device}, expected {D}"
    torch.testing.assert_close(got.cpu(), expected, msg=lambda m: f"{what}: {m}", **_TOL)


def _train_step(model: nn.Module, x: dict[str, torch.Tensor], case: Case) -> torch.Tensor:
    # AdamW's first step is lr * g / (|g| + eps) elementwise: gradients that are zero in exact
    # arithmetic (attention key biases) come out as ±1e-10 rounding noise, which eps=1e-8 would
    # turn into ±lr steps in either direction. eps=1e-5 keeps the step a function of the math,
    # not of the rounding; both sides use the same optimizer.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    loss = case.loss(model, x)
    loss.backward()
    opt.step()
    return loss


# --- the tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_forward_equals_eager(name: str, counts: Any) -> None:
    case = CASES[name]
    model, dmodel = _pair(case)
    model.eval()
    dmodel.eval()
    x = case.inputs()
    kw = dict(case.forward_kwargs)
    with torch.no_grad():
        expected = _tensors(model(**x, **kw))
        genie.reset_stats()
        got = _tensors(dmodel(**_to(x, D), **kw))
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        _close(g, e, f"output {i}")
    counts(name, "forward", genie.stats())


@pytest.mark.parametrize("name", list(CASES))
def test_train_step_equals_eager(name: str, counts: Any) -> None:
    case = CASES[name]
    model, dmodel = _pair(case)
    model.train()
    dmodel.train()
    x = case.inputs()
    loss = _train_step(model, x, case)
    genie.reset_stats()
    dloss = _train_step(dmodel, _to(x, D), case)
    _close(dloss, loss.detach(), "loss")
    params = list(model.named_parameters())
    dparams = list(dmodel.named_parameters())
    assert [n for n, _ in dparams] == [n for n, _ in params]  # same sharing (tied weights)
    for (n, p), (_, dp) in zip(params, dparams, strict=True):
        _close(dp.grad, p.grad, f"grad of {n}")
    for (n, p), (_, dp) in zip(params, dparams, strict=True):
        _close(dp.detach(), p.detach(), f"updated {n}")
    for (n, b), (_, db) in zip(model.named_buffers(), dmodel.named_buffers(), strict=True):
        _close(db, b, f"buffer {n}")
    counts(name, "train step", genie.stats())


def test_module_to_keeps_parameter_objects() -> None:
    """``.to(device)`` keeps each Parameter object, as ``.to("cuda")`` does: GPT-2's lm_head and
    wte stay one Parameter, and an optimizer built before the move still holds the model's."""
    torch.manual_seed(0)
    model = CASES["gpt2-eager"].build()
    before = list(model.parameters())
    model.to(D)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(p is q for p, q in zip(before, model.parameters(), strict=True))
    assert all(isinstance(p, nn.Parameter) and p.device.type == D for p in before)
    # Where a swap cannot work (a live CPU autograd graph holds the parameters), .to() still
    # succeeds, with new Parameter objects.
    lin = nn.Linear(3, 3)
    y = lin(torch.ones(3))
    lin.to(D)
    assert lin.weight.device.type == D
    y.sum().backward()


@pytest.mark.parametrize("name", ["gpt2-eager", "gpt2-sdpa", "llama-sdpa", "mixtral-sdpa"])
def test_greedy_generate_equals_eager(name: str, counts: Any) -> None:
    model, dmodel = _pair(CASES[name])
    model.eval()
    dmodel.eval()
    ids = torch.randint(3, VOCAB, (BATCH, 5))
    mask = torch.ones_like(ids)
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    expected = model.generate(ids, attention_mask=mask, **kw)
    genie.reset_stats()
    got = dmodel.generate(ids.to(D), attention_mask=mask.to(D), **kw)
    assert expected.shape == (BATCH, 5 + 8)
    assert torch.equal(got.cpu(), expected), f"tokens differ:\n{got.cpu()}\n{expected}"
    counts(name, "generate 8 tokens", genie.stats())


def test_generate_in_inference_mode_equals_eager() -> None:
    """``with torch.inference_mode(): model.generate(ids)``, the model and the prompt moved to the
    device before: views of their (normal) tensors taken in inference mode are normal tensors, as
    eager's (they raised ``Cannot set version_counter for inference tensor``)."""
    model, dmodel = _pair(CASES["gpt2-eager"])
    model.eval()
    dmodel.eval()
    ids = torch.randint(3, VOCAB, (BATCH, 5))
    dids = ids.to(D)
    kw = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    with torch.inference_mode():
        expected = model.generate(ids, **kw)
        got = dmodel.generate(dids, **kw)
    assert torch.equal(got.cpu(), expected), f"tokens differ:\n{got.cpu()}\n{expected}"


def test_transformer_encoder_padding_mask_inference() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2).eval()  # enable_nested_tensor=True (the default)
    dmodel = copy.deepcopy(model).to(D)
    x = torch.randn(BATCH, SEQ, 64)
    pad = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    pad[1, -3:] = True
    with torch.no_grad():
        expected = model(x, src_key_padding_mask=pad)
        got = dmodel(x.to(D), src_key_padding_mask=pad.to(D))
    _close(got, expected, "output")
