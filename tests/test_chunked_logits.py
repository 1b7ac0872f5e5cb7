"""Chunked log-probs through the LM head equal the full-logits results: the autograd function
against hand-computed numbers and against the pure loss functions (values and gradients), and a
real tiny model sharded by FSDP2 at world size 1 (LoRA, a trainable head, tied or not,
`logits_to_keep`, the RL role model with the entropy)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from posttrain.data.chat import IGNORE
from posttrain.distributed.fsdp import shard_model
from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.kinds.ingest import FromConfigModel
from posttrain.models.chunked import (
    IDENTITY,
    LogitTransform,
    chunked_target_logps,
    logit_transform,
    output_head,
    scoring_head,
    shifted_targets,
)
from posttrain.models.lora import apply_lora
from posttrain.models.roles import RoleModel
from posttrain.models.tiny import build_model
from posttrain.rl.losses import entropy_from_logits, token_logps
from posttrain.rl.rollout.sample import response_logps
from posttrain.sections.shared import LoraConfig
from posttrain.train.forward_logps import forward_nll_sum, forward_sequence_logps
from posttrain.train.losses import token_logps as label_token_logps
from posttrain.train.losses import token_nll_sum

ATOL = 1e-6


def test_hand_computed_logp_entropy_and_gradient() -> None:
    """H = 1, head weights (0, 1, 2): a hidden state of 1 gives logits (0, 1, 2)."""
    w = torch.tensor([[0.0], [1.0], [2.0]], requires_grad=True)
    h = torch.tensor([[1.0], [1.0]], requires_grad=True)
    logp, ent = chunked_target_logps(h, w, None, torch.tensor([2, 0]), chunk=1, entropy=True)
    z = math.log(1 + math.e + math.e**2)
    p = [1 / math.exp(z), math.e / math.exp(z), math.e**2 / math.exp(z)]
    assert logp.tolist() == pytest.approx([2 - z, 0 - z], abs=ATOL)
    expected_h = z - (p[1] * 1 + p[2] * 2)
    assert ent.tolist() == pytest.approx([expected_h] * 2, abs=ATOL)
    # d logp(2)/dh = w[2] - sum_j p_j w_j = 2 - (p1 + 2 p2); d logp(0)/dh = 0 - (p1 + 2 p2).
    logp.sum().backward()
    mean_w = p[1] + 2 * p[2]
    assert h.grad.squeeze(1).tolist() == pytest.approx([2 - mean_w, -mean_w], abs=ATOL)
    # d/dw_j summed over both rows (h = 1): onehot(2) + onehot(0) - 2 p.
    assert w.grad.squeeze(1).tolist() == pytest.approx(
        [1 - 2 * p[0], -2 * p[1], 1 - 2 * p[2]], abs=ATOL
    )


@pytest.mark.parametrize("chunk", [1, 3, 7, 0])
@pytest.mark.parametrize("bias", [False, True])
def test_function_equals_full_logits(chunk: int, bias: bool) -> None:
    """Log-probs, entropy and every gradient (hidden, weight, bias) of a mixed objective equal
    token_logps / entropy_from_logits on the full logits, for chunks that do and do not divide
    the token count."""
    torch.manual_seed(0)
    n, hid, vocab = 10, 16, 37
    h = torch.randn(n, hid, requires_grad=True)
    head = nn.Linear(hid, vocab, bias=bias)
    t = torch.randint(0, vocab, (n,))
    a, b = torch.randn(n), torch.randn(n)
    _assert_function_matches(h, head, t, a, b, chunk, IDENTITY)


def _assert_function_matches(
    h: torch.Tensor,
    head: nn.Linear,
    t: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    chunk: int,
    transform: LogitTransform,
    atol: float = ATOL,
    rtol: float = 0.0,
) -> None:
    """Chunked log-probs/entropy/gradients of sum(a logp + b H) equal the full-logits ones."""
    logits = transform.logits(head(h))
    ref_lp, ref_ent = token_logps(logits, t), entropy_from_logits(logits)
    params = [h, *head.parameters()]
    ref_grads = torch.autograd.grad((a * ref_lp).sum() + (b * ref_ent).sum(), params)

    lp, ent = chunked_target_logps(h, head.weight, head.bias, t, chunk, True, transform)
    grads = torch.autograd.grad((a * lp).sum() + (b * ent).sum(), params)
    torch.testing.assert_close(lp, ref_lp, atol=atol, rtol=rtol)
    torch.testing.assert_close(ent, ref_ent, atol=atol, rtol=rtol)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol)
    # Without the entropy: log-probs alone, and their gradient.
    lp2, none = chunked_target_logps(h, head.weight, head.bias, t, chunk, transform=transform)
    assert none is None
    g2 = torch.autograd.grad((a * lp2).sum(), params)
    r2 = torch.autograd.grad((a * token_logps(transform.logits(head(h)), t)).sum(), params)
    for g, r in zip(g2, r2, strict=True):
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol)


def test_an_entropy_left_out_of_the_loss_changes_no_gradient() -> None:
    """RL without an entropy bonus reports the entropy but leaves it out of the loss: its
    gradient then arrives as None (set_materialize_grads off), the backward skips its term,
    and the gradients are bit-equal to a loss that adds 0 x entropy (zeros materialized)."""
    torch.manual_seed(0)
    hidden = torch.randn(11, 8, requires_grad=True)
    weight = torch.randn(13, 8, requires_grad=True)
    targets = torch.randint(0, 13, (11,))
    grads = []
    for with_zero_entropy in (True, False):
        hidden.grad = weight.grad = None
        logp, ent = chunked_target_logps(hidden, weight, None, targets, 4, entropy=True)
        loss = -logp.sum() + (0.0 * ent.sum() if with_zero_entropy else 0.0)
        loss.backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("chunk", [3, 0])
@pytest.mark.parametrize(
    "transform",
    [
        LogitTransform(softcap=2.0),
        LogitTransform(scale=0.25),
        LogitTransform(3.0, 1.5),
        # Online RL's sampling temperature, alone and after a scale and a cap.
        LogitTransform(temperature=0.7),
        LogitTransform(3.0, 1.5, 0.5),
    ],
    ids=["softcap", "scale", "scale+softcap", "temperature", "scale+softcap+temperature"],
)
def test_function_with_logit_transform_equals_full_logits(
    chunk: int, transform: LogitTransform
) -> None:
    """Soft-capped and scaled logits: log-probs, entropy and gradients equal those of the
    transformed full logits; head outputs of a few units, so a cap of 2 bends them hard."""
    torch.manual_seed(0)
    n, hid, vocab = 10, 16, 37
    h = torch.randn(n, hid, requires_grad=True)
    head = nn.Linear(hid, vocab)
    with torch.no_grad():
        head.weight.mul_(4.0)
    t = torch.randint(0, vocab, (n,))
    a, b = torch.randn(n), torch.randn(n)
    # Dividing by a temperature makes logits (and the weight gradient's sums) larger: fp32
    # rounding grows with them, so those cases compare relative to their size.
    tol = {} if transform.temperature == 1.0 else {"atol": 1e-5, "rtol": 1e-5}
    _assert_function_matches(h, head, t, a, b, chunk, transform, **tol)
    # The transform is not a no-op here: the untransformed log-probs are far off.
    raw, _ = chunked_target_logps(h, head.weight, head.bias, t, chunk)
    assert (raw - token_logps(transform.logits(head(h)), t)).abs().max() > 0.1


def test_hand_computed_softcap_gradient() -> None:
    """One position, H = 1, weights (0, 1), h = 2, cap 1: logits (0, tanh 2); d logp(1)/dh =
    (1 - p1) * (1 - tanh^2 2) * 1."""
    w = torch.tensor([[0.0], [1.0]])
    h = torch.tensor([[2.0]], requires_grad=True)
    logp, _ = chunked_target_logps(
        h, w, None, torch.tensor([1]), 1, transform=LogitTransform(softcap=1.0)
    )
    t = math.tanh(2.0)
    p1 = math.exp(t) / (1 + math.exp(t))
    assert logp.item() == pytest.approx(math.log(p1), abs=ATOL)
    logp.sum().backward()
    assert h.grad.item() == pytest.approx((1 - p1) * (1 - t * t), abs=ATOL)


def test_logit_transform_from_real_configs() -> None:
    """Read from transformers' own config classes: Gemma-2 and Gemma-3 text soft-cap, Gemma-3's
    multimodal model (whose forward does not soft-cap), Cohere's multiplier, Granite's divisor,
    MiniCPM3's before-the-head divisor (nothing to do); unread architectures setting one, on
    their config or their text config, are refused."""
    from transformers import (
        CohereConfig,
        Gemma2Config,
        Gemma3Config,
        Gemma3TextConfig,
        GraniteConfig,
        LlamaConfig,
        LlavaConfig,
        MiniCPM3Config,
    )

    assert logit_transform(Gemma2Config()) == LogitTransform(softcap=30.0)
    assert logit_transform(Gemma2Config(final_logit_softcapping=None)) == IDENTITY
    capped = {"final_logit_softcapping": 30.0}
    assert logit_transform(Gemma3TextConfig(**capped)) == LogitTransform(softcap=30.0)
    assert logit_transform(Gemma3Config(text_config=capped)) == IDENTITY
    llava = LlavaConfig()
    llava.text_config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="model_type 'llava'"):
        logit_transform(llava)
    assert logit_transform(CohereConfig(logit_scale=0.0625)) == LogitTransform(scale=0.0625)
    assert logit_transform(GraniteConfig(logits_scaling=8.0)) == LogitTransform(scale=0.125)
    assert logit_transform(GraniteConfig()) == IDENTITY
    assert MiniCPM3Config(dim_model_base=64).logits_scaling != 1  # divides the hidden states
    assert logit_transform(MiniCPM3Config(dim_model_base=64)) == IDENTITY
    assert logit_transform(LlamaConfig()) == IDENTITY
    odd = LlamaConfig()
    odd.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="model_type 'llama'.*logits_chunk_tokens: 0"):
        logit_transform(odd)


def test_refuses_a_transformed_head_and_misaligned_targets() -> None:
    class Cfg:
        final_logit_softcapping = 30.0

    class M(nn.Module):
        config = Cfg()

        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 8)

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return self.lm_head(hidden)

    with pytest.raises(ValueError, match="final_logit_softcapping.*logits_chunk_tokens: 0"):
        output_head(M())
    M.config = None  # type: ignore[assignment]
    m = M()
    with (
        scoring_head(m, torch.zeros(2, 3, dtype=torch.long), 4),
        pytest.raises(ValueError, match="targets are"),
    ):
        m(torch.randn(2, 5, 4))
    # The head's own forward is back afterwards.
    assert m(torch.randn(2, 5, 4)).shape == (2, 5, 8)


# ---------------------------------------------------------------------------------------------
# A real tiny model under FSDP2 (world size 1)


class _Tok:
    pad_token_id, eos_token_id = 0, 1

    def __len__(self) -> int:
        return 512


@pytest.fixture
def mesh() -> Iterator[object]:
    d = init_distributed("cpu", 60, 1)
    try:
        yield d.mesh
    finally:
        shutdown()


def _model(tied: bool, lora: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = FromConfigModel(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        vocab_size=512,
        tie_word_embeddings=tied,
    )
    model = build_model(cfg, _Tok())
    model.config.use_cache = False
    if lora:
        model = apply_lora(model, LoraConfig(r=4, alpha=8))
        with torch.no_grad():  # LoRA B starts at 0, which would leave A without a gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model


def _batch(rows: int = 3, length: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 512, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, :5] = IGNORE  # prompt
    labels[1, 9:] = IGNORE  # padding
    attn = (labels != IGNORE).long()
    attn[:, :5] = 1
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": attn,
        "position_ids": torch.arange(length).expand(rows, length).clone(),
    }


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
            p.grad = None
    return out


def _assert_same(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], relative: bool = False
) -> None:
    """Same gradients to ATOL (with `relative`, ATOL times the largest gradient of the tensor:
    gradients of a few units carry fp32 rounding of a few 1e-6 on either path)."""
    assert a.keys() == b.keys() and a
    for k in a:
        atol = ATOL * max(1.0, float(b[k].abs().max())) if relative else ATOL
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=2e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize(("tied", "lora"), [(True, True), (False, False), (True, False)])
def test_sft_and_dpo_losses_under_fsdp2(mesh: object, tied: bool, lora: bool) -> None:
    """NLL sum and per-row sequence log-probs, and the gradients of every trainable parameter
    (LoRA adapters; or the whole model with the head, tied to the embedding or not), are the
    same chunked as unchunked."""
    model = shard_model(_model(tied, lora), mesh, "fp32")
    batch = _batch()
    (nll0, n0), (nll1, n1) = (forward_nll_sum(model, batch, c) for c in (0, 5))
    assert int(n0) == int(n1) == int((batch["labels"][:, 1:] != IGNORE).sum())
    torch.testing.assert_close(nll1, nll0, atol=1e-5, rtol=1e-6)
    nll0.backward()
    ref = _grads(model)
    forward_nll_sum(model, batch, 5)[0].backward()
    _assert_same(_grads(model), ref)
    if not lora:
        head = "lm_head.weight" if not tied else "model.embed_tokens.weight"
        assert head in ref

    (lp0, len0), (lp1, len1) = (forward_sequence_logps(model, batch, c) for c in (0, 4))
    assert torch.equal(len0, len1)
    torch.testing.assert_close(lp1, lp0, atol=ATOL, rtol=1e-6)
    (lp0 * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
    ref = _grads(model)
    (lp1 * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
    _assert_same(_grads(model), ref)


def test_bf16_mixed_precision(mesh: object) -> None:
    """Under FSDP2's bf16 MixedPrecisionPolicy the head's matmul runs in bf16 and the chunk's
    log-softmax in fp32, as the unchunked path does (lm_head in bf16, then .float()): the NLL and
    the gradients of a trainable, untied head agree to bf16 rounding."""
    model = shard_model(_model(False, False), mesh, "bf16")
    batch = _batch()
    nll0, _ = forward_nll_sum(model, batch, 0)
    nll0.backward()
    ref = _grads(model)
    nll1, _ = forward_nll_sum(model, batch, 4)
    assert nll1.dtype == torch.float32
    nll1.backward()
    got = _grads(model)
    torch.testing.assert_close(nll1, nll0, atol=1e-3, rtol=1e-3)
    for k in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
        torch.testing.assert_close(got[k], ref[k], atol=2e-3, rtol=2e-2)


def test_logits_to_keep_and_plain_logits_after(mesh: object) -> None:
    """With logits_to_keep = k the head sees the last k positions: targets for those columns
    give the full-logits values there; outside the context the model returns logits again."""
    model = shard_model(_model(True, True), mesh, "fp32")
    batch = _batch()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    full = model(**inputs).logits  # [B, T, V]
    targets = shifted_targets(batch["labels"])[:, -6:]
    with scoring_head(model, targets, 2):
        got = model(**inputs, logits_to_keep=6).logits  # [B, 6]
    mask = targets != IGNORE
    want = token_logps(full[:, -6:], targets.clamp(min=0)) * mask
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert model(**inputs).logits.shape == full.shape
    # The old pure functions read the same numbers from the full logits.
    nll, _ = token_nll_sum(full, batch["labels"])
    with torch.no_grad():
        chunked, _ = forward_nll_sum(model, batch, 3)
    assert float(nll.detach()) == pytest.approx(float(chunked), rel=1e-6)
    logps, mask = label_token_logps(full, batch["labels"])  # [B, T-1] each
    with torch.no_grad():
        seq, n = forward_sequence_logps(model, batch, 3)  # [B] each, through the chunked head
    assert seq.shape == (3,)
    torch.testing.assert_close(seq, logps.detach().sum(-1), atol=1e-5, rtol=1e-6)
    assert n.tolist() == mask.sum(-1).tolist()


def _rl_inputs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """ids [4, 10] as RL scoring sees them: a 5-token prompt, a 5-token response (row 1 stopped
    after 3), and the role model's inputs (positions 4..8 predict the response)."""
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    inp = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(10).expand(4, 10).clone(),
        "start": 4,
        "stop": 9,
    }
    return ids[:, 5:], mask, inp


def test_role_model_policy_loss_under_fsdp2(mesh: object) -> None:
    """The RL role model: response log-probs of the policy and reference, the entropy, and the
    gradient of a policy-loss-like objective on the policy adapter are the same chunked."""
    lm = _model(True, True)
    lm.add_adapter("reference", lm.peft_config["default"])
    for name, p in lm.named_parameters():
        p.requires_grad_(".default." in name)
    model = shard_model(RoleModel(lm, nn.Linear(32, 1), None), mesh, "fp32")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 512, (4, 10), generator=g)
    response, mask, inp = _rl_inputs(ids)
    weights = torch.randn(4, 5, generator=g)
    out = {}
    for chunk in (0, 3):
        with torch.no_grad():
            ref, _ = response_logps(model, "reference", inp, response, mask, chunk)
        lp, ent = response_logps(model, "default", inp, response, mask, chunk, entropy=True)
        ((weights * lp - 0.1 * ent) * mask).sum().backward()
        out[chunk] = (ref * mask, lp * mask, ent * mask, _grads(model))
    for a, b in zip(out[0][:3], out[3][:3], strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    assert all(".default." in k for k in out[0][3])
    _assert_same(out[3][3], out[0][3])


@pytest.mark.slow
def test_sft_stage_same_trajectory_chunked_and_unchunked(tmp_path: Path) -> None:
    """The real sft stage with the head in chunks of 16 tokens and with full logits: the same
    losses, gradient norms and held-out losses step by step (the setting is not part of the
    fingerprint, so the variants run in workspaces of their own)."""
    from stage_helpers import TINY, planned_dir, run_inprocess, run_shared, write_recipe

    from posttrain.telemetry.records import read_metrics

    data = copy.deepcopy(TINY)
    data["ingest"]["from_config"]["pretrain_steps"] = 5
    data["sft"]["max_steps"] = 4
    variants = {
        "full": ("infra.logits_chunk_tokens=0",),
        "chunked": ("infra.logits_chunk_tokens=16",),
    }
    recipes = {}
    for name in variants:
        (tmp_path / name).mkdir()
        recipes[name] = write_recipe(tmp_path / name, data)
        run_shared("ingest", recipes[name], tmp_path / "ingest")
    dirs = {planned_dir("sft", recipes[n], *v) for n, v in variants.items()}
    assert len({d.name for d in dirs}) == 1 and len(dirs) == 2  # one print, two workspaces
    runs = {}
    for name, over in variants.items():
        out = run_inprocess("sft", recipes[name], *over)
        runs[name] = (
            read_metrics(out / "metrics.jsonl", "train"),
            read_metrics(out / "metrics.jsonl", "eval"),
        )
    (full_train, full_eval), (ch_train, ch_eval) = runs["full"], runs["chunked"]
    assert len(full_train) == len(ch_train) == 4
    for a, b in zip(full_train, ch_train, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert [r["eval_loss"] for r in ch_eval] == pytest.approx(
        [r["eval_loss"] for r in full_eval], rel=1e-5
    )


# ---------------------------------------------------------------------------------------------
# Architectures whose logits are a transform of the head's output, real tiny models


def _transformed_model(family: str, lora: bool) -> nn.Module:
    """A tiny Gemma-2 (soft-cap 3), Cohere (logit_scale 0.5) or Granite (logits_scaling 4) with
    an initialisation wide enough that the head's output reaches a few units (so the cap bends
    it), tied head."""
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
    )

    torch.manual_seed(0)
    dims = {
        "vocab_size": 512,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "initializer_range": 0.3,
        "use_cache": False,
    }
    if family == "gemma2":
        cfg = Gemma2Config(
            **dims, head_dim=8, final_logit_softcapping=3.0, attn_implementation="eager"
        )
        model = Gemma2ForCausalLM(cfg)
    elif family == "cohere":
        model = CohereForCausalLM(CohereConfig(**dims, logit_scale=0.5))
    else:
        model = GraniteForCausalLM(GraniteConfig(**dims, logits_scaling=4.0))
    if lora:
        model = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize(
    ("family", "lora"),
    [("gemma2", True), ("gemma2", False), ("cohere", False), ("granite", True)],
)
def test_transformed_logits_models_under_fsdp2(mesh: object, family: str, lora: bool) -> None:
    """Gemma-2 (soft-cap), Cohere (scale) and Granite (divisor): NLL sums, per-row sequence
    log-probs and the gradients of every trainable parameter through the chunked head equal
    those of the model's own logits (chunk 0 = model(...).logits -> log_softmax); without the
    transform the chunked numbers would be far off."""
    model = shard_model(_transformed_model(family, lora), mesh, "fp32")
    batch = _batch()
    nll0, n0 = forward_nll_sum(model, batch, 0)
    nll1, n1 = forward_nll_sum(model, batch, 5)
    assert int(n0) == int(n1)
    torch.testing.assert_close(nll1, nll0, atol=1e-5, rtol=1e-6)
    # The SFT loss: the mean over label tokens (a sum of ~20 tokens' gradients through a wide
    # initialisation differs in fp32 rounding by a few 1e-6 on both paths alike).
    (nll0 / n0).backward()
    ref = _grads(model)
    (nll1 / n1).backward()
    _assert_same(_grads(model), ref)
    if not lora:
        assert "model.embed_tokens.weight" in ref  # the tied head trains too

    weights = torch.tensor([1.0, -2.0, 0.5])
    (lp0, len0), (lp1, len1) = (forward_sequence_logps(model, batch, c) for c in (0, 4))
    assert torch.equal(len0, len1)
    torch.testing.assert_close(lp1, lp0, atol=ATOL, rtol=1e-6)
    (lp0 * weights).sum().backward()
    ref = _grads(model)
    (lp1 * weights).sum().backward()
    _assert_same(_grads(model), ref, relative=True)

    # The transform matters at this scale: the head's raw output scores differently.
    config = model.config
    name = {"gemma2": "final_logit_softcapping", "cohere": "logit_scale"}.get(
        family, "logits_scaling"
    )
    kept = getattr(config, name)
    setattr(config, name, None if family == "gemma2" else 1.0)
    try:
        with torch.no_grad():
            raw, _ = forward_sequence_logps(model, batch, 4)
    finally:
        setattr(config, name, kept)
    assert (raw - lp0.detach()).abs().max() > 0.5


def test_role_model_gemma2_softcap_under_fsdp2(mesh: object) -> None:
    """The RL role model on Gemma-2: response log-probs and entropy are those of the model's
    own (soft-capped) logits on both paths, and chunked equals unchunked with gradients."""
    lm = _transformed_model("gemma2", True)
    lm.add_adapter("reference", lm.peft_config["default"])
    for name, p in lm.named_parameters():
        p.requires_grad_(".default." in name)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 512, (4, 10), generator=g)
    with torch.no_grad():  # the causal LM's own logits (soft-capped), default adapter
        own = lm(input_ids=ids).logits[:, 4:9]
    model = shard_model(RoleModel(lm, nn.Linear(32, 1), None), mesh, "fp32")
    response, mask, inp = _rl_inputs(ids)
    weights = torch.randn(4, 5, generator=g)
    out = {}
    for chunk in (0, 3):
        lp, ent = response_logps(model, "default", inp, response, mask, chunk, entropy=True)
        ((weights * lp - 0.1 * ent) * mask).sum().backward()
        out[chunk] = (lp * mask, ent * mask, _grads(model))
    want = token_logps(own, response) * mask
    torch.testing.assert_close(out[0][0].detach(), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        out[0][1].detach(), entropy_from_logits(own) * mask, atol=ATOL, rtol=0
    )
    for a, b in zip(out[0][:2], out[3][:2], strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    _assert_same(out[3][2], out[0][2])
