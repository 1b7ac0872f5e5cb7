"""The compiled chunk of the LM head (`infra.logits_head: compiled`,
`posttrain.models.compiled_head`) against the eager chunked head, its reference: log-probs,
entropies and the gradients of hidden, weight and bias, with each kind of `LogitTransform`, for
token counts that do and do not fill the last chunk (one of a single row), with one graph for
the forward and one for the backward whatever the count (dynamo's counters, as
tests/test_compile.py counts them). Inductor compiles for the CPU here.

Tolerances: fp32 to 1e-5 (both paths are within ~5e-6 of a float64 computation on these shapes:
fusions reorder the vocabulary sums); bf16 to bf16 rounding (2e-2 relative)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from test_chunked_logits import _batch, _grads, _model, _rl_inputs
from torch import nn

from posttrain.distributed.fsdp import shard_model
from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.models.chunked import IDENTITY, LogitTransform, chunked_target_logps, output_head
from posttrain.models.compile import CompileStats
from posttrain.models.compiled_head import is_compiled, logits_head_compiled, use_compiled_head
from posttrain.models.roles import RoleModel
from posttrain.rl.rollout.sample import response_logps
from posttrain.sections.infra import InfraConfig
from posttrain.train.forward_logps import forward_nll_sum

COUNTS = [37, 5, 64, 1, 13]  # chunk 8: a partial last chunk, one chunk, full chunks, one row


def test_auto_is_compiled_where_the_blocks_are() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert InfraConfig().logits_head == "auto"
    assert not logits_head_compiled("auto", "auto", cpu)
    assert logits_head_compiled("auto", "auto", cuda)
    assert logits_head_compiled("auto", True, cpu)
    assert not logits_head_compiled("auto", False, cuda)
    assert logits_head_compiled("compiled", False, cpu)
    assert not logits_head_compiled("chunked", True, cuda)
    head = nn.Linear(4, 8)
    assert not is_compiled(head)
    use_compiled_head(head)
    assert is_compiled(head)


def _scores_and_grads(
    h: torch.Tensor,
    head: nn.Linear,
    t: torch.Tensor,
    transform: LogitTransform,
    compiled: bool,
    entropy: bool = True,
) -> list[torch.Tensor]:
    """[logp, entropy?, grads of sum(a logp + b H) for h and every head parameter that needs
    one]; a, b fixed random weights per position (arbitrary upstream gradients, as DPO/RL)."""
    g = torch.Generator().manual_seed(h.size(0))
    a, b = (torch.randn(h.size(0), generator=g).to(h.device) for _ in range(2))
    lp, ent = chunked_target_logps(h, head.weight, head.bias, t, 8, entropy, transform, compiled)
    objective = (a * lp).sum() + ((b * ent).sum() if ent is not None else 0.0)
    params = [p for p in (h, *head.parameters()) if p.requires_grad]
    return [lp, *([ent] if ent is not None else []), *torch.autograd.grad(objective, params)]


def _compare_over_counts(
    head: nn.Linear, transform: LogitTransform, entropy: bool = True, dtype=torch.float32
) -> list[int]:
    """Compiled vs eager for every count in COUNTS; returns the graphs compiled per count."""
    torch._dynamo.reset()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    graphs = []
    for n in COUNTS:
        torch.manual_seed(n)
        h = torch.randn(n, head.in_features, dtype=dtype, requires_grad=True)
        t = torch.randint(0, head.out_features, (n,))
        want = _scores_and_grads(h, head, t, transform, False, entropy)
        before = CompileStats.now()
        got = _scores_and_grads(h, head, t, transform, True, entropy)
        graphs.append(CompileStats.now().since(before)["graphs_compiled"])
        assert len(got) == len(want)
        for i, (x, y) in enumerate(zip(got, want, strict=True)):
            assert x.dtype == y.dtype
            torch.testing.assert_close(x, y, **tol, msg=lambda m, i=i, n=n: f"n={n} #{i}: {m}")
    return graphs


@pytest.mark.slow
@pytest.mark.parametrize(
    "transform",
    [IDENTITY, LogitTransform(softcap=2.0), LogitTransform(3.0, 1.5, 0.7)],
    ids=["identity", "softcap", "scale+softcap+temperature"],
)
def test_compiled_chunk_equals_eager_without_recompiling(transform: LogitTransform) -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 301)  # a trainable head with a bias: every gradient
    graphs = _compare_over_counts(head, transform)
    assert graphs == [2, 0, 0, 0, 0], graphs  # forward and backward, once


@pytest.mark.slow
def test_compiled_log_probs_only_through_a_frozen_head() -> None:
    """No entropy, a frozen head without a bias (LoRA training): the gradient of the hidden
    states alone, still one graph each way."""
    torch.manual_seed(0)
    head = nn.Linear(16, 301, bias=False).requires_grad_(False)
    assert _compare_over_counts(head, IDENTITY, entropy=False) == [2, 0, 0, 0, 0]


@pytest.mark.slow
def test_compiled_bf16_and_autocast() -> None:
    """A bf16 head and hidden states (a bf16 base), and an fp32 head under bf16 autocast (the
    single-device mixed precision): the compiled chunk follows eager to bf16 rounding; scores
    stay fp32, gradients in the inputs' dtypes."""
    torch.manual_seed(0)
    head = nn.Linear(16, 301).to(torch.bfloat16)
    assert _compare_over_counts(head, IDENTITY, dtype=torch.bfloat16)[0] == 2
    head = nn.Linear(16, 301)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _compare_over_counts(head, LogitTransform(softcap=2.0), dtype=torch.float32)


@pytest.fixture
def mesh() -> Iterator[object]:
    d = init_distributed("cpu", 60, 1)
    try:
        yield d.mesh
    finally:
        shutdown()


@pytest.mark.slow
def test_compiled_head_under_fsdp2(mesh: object) -> None:
    """A tiny model sharded by FSDP2 (world size 1), its head marked compiled: the SFT NLL and
    every gradient of the whole model (the head tied to the embedding) as the eager chunked
    head gives them; then the RL role model's policy and reference log-probs and entropy and
    the policy adapter's gradients."""
    torch._dynamo.reset()
    model = shard_model(_model(True, False), mesh, "fp32")
    batch = _batch()
    out = []
    for compiled in (False, True):
        use_compiled_head(output_head(model), compiled)
        nll, _ = forward_nll_sum(model, batch, 5)
        nll.backward()
        out.append((nll.detach(), _grads(model)))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-5, rtol=1e-6)
    assert out[0][1].keys() == out[1][1].keys()
    for k, want in out[0][1].items():
        torch.testing.assert_close(out[1][1][k], want, atol=1e-5, rtol=1e-5, msg=k)

    lm = _model(True, True)
    lm.add_adapter("reference", lm.peft_config["default"])
    for name, p in lm.named_parameters():
        p.requires_grad_(".default." in name)
    role = shard_model(RoleModel(lm, nn.Linear(32, 1), None), mesh, "fp32")
    ids = torch.randint(2, 512, (4, 10), generator=torch.Generator().manual_seed(2))
    response, mask, inp = _rl_inputs(ids)
    scores = []
    for compiled in (False, True):
        use_compiled_head(output_head(lm), compiled)
        with torch.no_grad():
            ref, _ = response_logps(role, "reference", inp, response, mask, 3)
        lp, ent = response_logps(role, "default", inp, response, mask, 3, entropy=True)
        ((lp - 0.1 * ent) * mask).sum().backward()
        scores.append((ref * mask, lp.detach() * mask, ent.detach() * mask, _grads(role)))
    for x, y in zip(scores[1][:3], scores[0][:3], strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for k, want in scores[0][3].items():
        torch.testing.assert_close(scores[1][3][k], want, atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_chunk_equals_eager_on_cuda() -> None:
    """bf16 on CUDA, the target: Triton kernels for the fused passes, no recompiles."""
    torch.manual_seed(0)
    head = nn.Linear(64, 4099).to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    graphs = []
    for n in COUNTS:
        h = torch.randn(n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        t = torch.randint(0, 4099, (n,), device="cuda")
        want = _scores_and_grads(h, head, t, LogitTransform(softcap=30.0), False)
        before = CompileStats.now()
        got = _scores_and_grads(h, head, t, LogitTransform(softcap=30.0), True)
        graphs.append(CompileStats.now().since(before)["graphs_compiled"])
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, atol=2e-2, rtol=2e-2)
    assert graphs == [2, 0, 0, 0, 0], graphs
