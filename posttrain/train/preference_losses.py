"""The DPO family of preference losses: small pure functions over sequence log-probs, and a registry.

Every loss sees, for a batch of B (prompt, chosen, rejected) pairs, the log-probability of each
whole response summed over its tokens:

    policy_chosen_logps, policy_rejected_logps: [B]  log pi(y | x) under the model being trained
    ref_chosen_logps, ref_rejected_logps:       [B]  the same under the frozen reference
                                                     (None for reference-free losses)
    chosen_lengths, rejected_lengths:           [B]  number of response tokens (SimPO only)

passed positionally in that order (unused ones are accepted and ignored, so the loop calls
whichever loss the config names without branching), and returns `(losses [B], chosen_rewards [B],
rejected_rewards [B])`. The caller takes the mean of `losses` over the global batch; the rewards
are the loss's implicit rewards, detached, for metrics. `preference_loss(name, **hparams)` binds a
loss's hyperparameters once, at setup, and fails there on a bad name or value.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.train.losses import pair_outcome, pair_tie

LossOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
PreferenceLoss = Callable[..., LossOutput]


def _check(beta: float, label_smoothing: float = 0.0) -> None:
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    # Above 0.5 the smoothed loss prefers the rejected response: a config mistake, not a prior.
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")


def _by_log_ratios(
    logps: tuple[torch.Tensor | None, ...],
    beta: float,
    loss_of_margin: Callable[[torch.Tensor], torch.Tensor],
) -> LossOutput:
    """A reference-based loss: `loss_of_margin(h)`, h = (pi_c - ref_c) - (pi_r - ref_r) [B]
    from the first four `logps`, and the rewards beta * (pi - ref). Upcast first: the four sums
    can be hundreds of nats apart in magnitude, and their difference in fp16/bf16 loses the
    small margin the loss actually depends on (the NaN/inf preference losses of TRL#878)."""
    policy_chosen, policy_rejected, ref_chosen, ref_rejected = logps[:4]
    assert ref_chosen is not None and ref_rejected is not None, "a log-ratio needs ref_*_logps"
    chosen = policy_chosen.float() - ref_chosen.float()
    rejected = policy_rejected.float() - ref_rejected.float()
    return loss_of_margin(chosen - rejected), (beta * chosen).detach(), (beta * rejected).detach()


def implicit_rewards(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    lengths: torch.Tensor | None,
    *,
    beta: float,
    loss: str,
) -> torch.Tensor:
    """The reward that loss `loss` implicitly gives each response, for held-out metrics: the
    DPO stage's held-out accuracy and margin and evaluate's implicit-reward accuracy both read
    it, so they cannot disagree (each loss below returns the same values for its pairs; a test
    holds them to it).

        reference-based losses (sigmoid, robust, ipo, hinge):
            r = beta * (log pi(y|x) - log ref(y|x))      log-probs summed over the response
        reference-free losses (REFERENCE_FREE: simpo):
            r = beta * log pi(y|x) / |y|                 per-token average, no reference

    policy_logps [N]; ref_logps [N], or None for a reference-free loss; lengths [N] response
    tokens (>= 1), read by reference-free losses only. Returns [N] float32, detached.
    """
    if loss not in PREFERENCE_LOSSES:
        raise _unknown(loss)
    if loss in REFERENCE_FREE:
        assert lengths is not None, f"the {loss} reward is length-normalised: pass lengths"
        rewards = beta * policy_logps.float() / lengths.float()
    else:
        assert ref_logps is not None, f"the {loss} reward is a log-ratio: pass ref_logps"
        rewards = beta * (policy_logps.float() - ref_logps.float())  # upcast first
    return rewards.detach()


def _smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    # The expected logistic loss when each preference label is flipped with probability eps.
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def sigmoid_loss(
    *logps: torch.Tensor | None, beta: float, label_smoothing: float = 0.0
) -> LossOutput:
    """DPO (Rafailov et al., 2023), with the conservative label smoothing of cDPO.

        logits = beta * ((pi_c - ref_c) - (pi_r - ref_r))
        loss   = -log sigmoid(logits) * (1 - eps) - log sigmoid(-logits) * eps

    eps = label_smoothing in [0, 0.5]; eps = 0 is plain DPO.
    """
    _check(beta, label_smoothing)
    return _by_log_ratios(logps, beta, lambda h: _smoothed_sigmoid(beta * h, label_smoothing))


def robust_loss(
    *logps: torch.Tensor | None, beta: float, label_smoothing: float = 0.0
) -> LossOutput:
    """Robust DPO (Chowdhury et al., 2024): an unbiased estimate of the clean-label DPO loss when
    each label is flipped with probability eps.

        logits = beta * ((pi_c - ref_c) - (pi_r - ref_r))
        loss   = (-log sigmoid(logits) * (1 - eps) + log sigmoid(-logits) * eps) / (1 - 2 eps)

    Unlike cDPO (`sigmoid` with eps > 0), the flipped-label term enters with a minus sign, which
    de-biases the gradient instead of capping the margin. Needs eps < 0.5 (the division).
    """
    _check(beta, label_smoothing)
    if label_smoothing >= 0.5:
        raise ValueError(f"robust loss needs label_smoothing < 0.5, got {label_smoothing}")
    eps = label_smoothing

    def loss(h: torch.Tensor) -> torch.Tensor:
        logits = beta * h
        return (-F.logsigmoid(logits) * (1 - eps) + F.logsigmoid(-logits) * eps) / (1 - 2 * eps)

    return _by_log_ratios(logps, beta, loss)


def ipo_loss(*logps: torch.Tensor | None, beta: float) -> LossOutput:
    """IPO (Azar et al., 2023, eq. 17), beta being the paper's tau.

        h    = (pi_c - ref_c) - (pi_r - ref_r)
        loss = (h - 1 / (2 beta))^2

    A squared loss regresses the log-ratio margin to a finite target instead of pushing it to
    infinity, so IPO does not overfit deterministic preferences the way DPO can.

    h uses the SUMMED log-probs, as the paper defines it (log-likelihood ratios of whole
    responses). TRL instead averages log-probs over response tokens for IPO, which makes the
    target 1/(2 beta) independent of response length. We keep the paper's definition so all
    reference-based losses here share one input and `beta` means what the paper says; the cost
    is that a beta tuned for TRL's IPO is not transferable (summed margins are ~length times
    larger, so the matching target, and hence beta, differs).
    """
    _check(beta)
    return _by_log_ratios(logps, beta, lambda h: (h - 1 / (2 * beta)) ** 2)


def hinge_loss(*logps: torch.Tensor | None, beta: float) -> LossOutput:
    """SLiC-HF's calibration loss (Zhao et al., 2023) on the DPO log-ratio margin:
    loss = relu(1 - beta * h). Zero (and zero gradient) once the margin exceeds 1/beta, so
    well-separated pairs stop pulling on the model."""
    _check(beta)
    return _by_log_ratios(logps, beta, lambda h: torch.relu(1 - beta * h))


def simpo_loss(
    *logps: torch.Tensor | None, beta: float, gamma: float, label_smoothing: float = 0.0
) -> LossOutput:
    """SimPO (Meng et al., 2024): reference-free, length-normalised, with a target margin.

        r      = beta * logp / len                    (the implicit reward, per response)
        logits = r_c - r_r - gamma
        loss   = -log sigmoid(logits) * (1 - eps) - log sigmoid(-logits) * eps

    gamma is the paper's target reward margin (TRL's `simpo_gamma`), on the scale of the
    already beta-scaled rewards. Dividing by the length removes DPO's incentive to prefer longer
    responses, and matches how generation scores a response (average log-prob per token).
    ref_* are ignored (pass None); chosen_lengths, rejected_lengths [B] are required (>= 1).
    """
    _check(beta, label_smoothing)
    assert len(logps) == 6 and None not in logps[4:], "SimPO needs lengths"
    policy_chosen, policy_rejected, _, _, chosen_lengths, rejected_lengths = logps
    chosen = beta * policy_chosen.float() / chosen_lengths.float()
    rejected = beta * policy_rejected.float() / rejected_lengths.float()
    losses = _smoothed_sigmoid(chosen - rejected - gamma, label_smoothing)
    return losses, chosen.detach(), rejected.detach()


PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "sigmoid": sigmoid_loss,
    "robust": robust_loss,
    "ipo": ipo_loss,
    "hinge": hinge_loss,
    "simpo": simpo_loss,
}

# Losses that never read ref_*_logps: the stage can skip building and running a reference model.
REFERENCE_FREE = {"simpo"}


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown preference loss {name!r}; known: {', '.join(sorted(PREFERENCE_LOSSES))}"
    )


def loss_hyperparameters(name: str) -> list[str]:
    """The hyperparameters loss `name` takes, e.g. ["beta", "label_smoothing"] for "sigmoid"."""
    if name not in PREFERENCE_LOSSES:
        raise _unknown(name)
    params = inspect.signature(PREFERENCE_LOSSES[name]).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def preference_loss(name: str, **hparams: float) -> PreferenceLoss:
    """The loss `name` with its hyperparameters bound: call it with the tensors only. Raises
    ValueError for an unknown name, a hyperparameter the loss does not take, or an invalid value:
    the bound loss runs once on a one-pair batch here, so a bad value fails at setup rather than
    at the first training step, after the models are loaded."""
    takes = loss_hyperparameters(name)
    unknown = sorted(set(hparams) - set(takes))
    if unknown:
        raise ValueError(
            f"preference loss {name!r} takes {', '.join(takes)}; got unexpected {', '.join(unknown)}"
        )
    fn = PREFERENCE_LOSSES[name]
    bound = functools.partial(fn, **hparams)
    one, zero = torch.ones(1), torch.zeros(1)
    try:
        bound(zero, zero, zero, zero, one, one)
    except TypeError as exc:  # a required hyperparameter is missing
        raise ValueError(f"preference loss {name!r}: {exc}") from None
    return bound


def nll_term(policy_chosen_logps: torch.Tensor, chosen_lengths: torch.Tensor) -> torch.Tensor:
    """Optional SFT term on the chosen responses (as in RPO / CPO), added by the caller:
    nll = mean_b(-policy_chosen_logps[b] / chosen_lengths[b]), inputs [B], a scalar. Each pair
    weighs the same whatever its length, matching how the preference losses weigh pairs."""
    return (-policy_chosen_logps.float() / chosen_lengths.float()).mean()


# --- KTO (unpaired feedback) ---------------------------------------------------------------------


def kto_kl_estimate(
    policy_kl_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """KTO's reference point z0 (Ethayarajh et al., 2024, eq. 7): a detached, clamped batch
    estimate of KL(pi || ref), from MISMATCHED pairs (prompt x_i with the completion of another
    row, so the estimate is not the rows' own rewards):

        z0 = max(0, sum_i (pi_kl[i] - ref_kl[i]) / n)     n = mismatched pairs in the batch

    Inputs [B] summed log-probs of the mismatched sequences. `reduce` sums a [2] tensor
    (sum, count) over ranks so every rank gets the global batch's estimate (None: this batch
    alone). Returns a scalar float32 tensor with no gradient.
    """
    with torch.no_grad():
        diff = policy_kl_logps.detach().float() - ref_kl_logps.detach().float()
        totals = torch.stack([diff.sum(), torch.tensor(float(diff.numel()), device=diff.device)])
        if reduce is not None:
            totals = reduce(totals)
        return (totals[0] / totals[1].clamp(min=1.0)).clamp(min=0.0)


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO (Ethayarajh et al., 2024, eq. 8) on B unpaired rows.

        r    = pi - ref                                   (summed response log-probs) [B]
        loss = lambda_D * (1 - sigmoid(beta * (r - z0)))  for a desirable row
               lambda_U * (1 - sigmoid(beta * (z0 - r)))  for an undesirable row

    desirable: [B] bool; kl: the scalar z0 from `kto_kl_estimate`. Returns (losses [B],
    metrics): sums over this batch, so they add across micro-batches and ranks (implicit reward
    beta * r of desirable and undesirable rows, their counts) and "kl" (z0 as given).
    """
    _check(beta)
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"KTO weights must be >= 0, got desirable {desirable_weight}, "
            f"undesirable {undesirable_weight}"
        )
    r = policy_logps.float() - ref_logps.float()  # upcast first, as in _by_log_ratios
    z0 = kl.detach().float()
    good = desirable.bool()
    losses = torch.where(
        good,
        desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))),
    )
    rewards = (beta * r).detach()
    metrics = {
        "reward_desirable": rewards[good].sum(),
        "reward_undesirable": rewards[~good].sum(),
        "n_desirable": good.sum().float(),
        "n_undesirable": (~good).sum().float(),
        "kl": z0,
    }
    return losses, metrics


def kto_summary(sums: dict[str, Any]) -> dict[str, Any]:
    """`kto_loss` metrics summed over a batch -> mean rewards (0 with no rows) and margin;
    Python floats or 0-dim tensors (a training step's, left on the device), as given."""
    d = sums["reward_desirable"] / _at_least_one(sums["n_desirable"])
    u = sums["reward_undesirable"] / _at_least_one(sums["n_undesirable"])
    return {
        "reward_desirable": d,
        "reward_undesirable": u,
        "margin": d - u,
        "n_desirable": sums["n_desirable"],
        "n_undesirable": sums["n_undesirable"],
        "kl": sums["kl"],
    }


def _at_least_one(n: Any) -> Any:
    return n.clamp(min=1.0) if isinstance(n, torch.Tensor) else max(1.0, n)


def kto_weight_balance(
    n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float
) -> float | None:
    """lambda_D * n_D / (lambda_U * n_U): the paper recommends [1, 4/3] (section 4.2). None when
    it is undefined (no undesirable row, or undesirable_weight 0)."""
    denom = undesirable_weight * n_undesirable
    return desirable_weight * n_desirable / denom if denom else None


# --- ORPO: a reference-free loss with its own inputs (no registry entry: it is its own stage) ---


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stably (Maechler, 2012): log(-expm1(x)) near 0, where
    1 - exp(x) cancels, and log1p(-exp(x)) further out, where expm1 loses digits."""
    return torch.where(
        x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x))
    )


# Cap on the per-token mean log-prob fed to log-odds: a response the model is certain of has
# mean logp 0.0 in fp32, whose odds are infinite. -1e-6 caps its log-odds at ~13.8.
_ORPO_MAX_MEAN_LOGP = -1e-6


def orpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO (Hong et al., 2024): SFT on the chosen response plus an odds-ratio penalty, with no
    reference model.

        m_y        = logp(y | x) / len(y)                  (mean per-token log-prob)
        log_odds_y = m_y - log(1 - exp(m_y))               (log of p / (1 - p), p = exp(m_y))
        ratio      = log_odds_c - log_odds_r
        loss       = -m_c + beta * (-log sigmoid(ratio))   (NLL of chosen + beta * L_OR)

    beta is the paper's lambda (TRL's `beta`). The NLL is per pair, so pairs weigh equally
    whatever their length, as in `nll_term`. Inputs: summed response log-probs and response
    token counts (>= 1), each [B]. Returns (losses [B], metrics: detached [B] tensors; rewards
    are beta * m_y as in TRL, and log_odds_ratio is what TRL calls `log_odds_chosen`).
    """
    _check(beta)
    # Upcast as in _by_log_ratios: the odds of means near 0 need fp32 at least.
    chosen = (policy_chosen_logps.float() / chosen_lengths.float()).clamp(max=_ORPO_MAX_MEAN_LOGP)
    rejected = (policy_rejected_logps.float() / rejected_lengths.float()).clamp(
        max=_ORPO_MAX_MEAN_LOGP
    )
    odds_c = chosen - log1mexp(chosen)
    odds_r = rejected - log1mexp(rejected)
    ratio = odds_c - odds_r
    or_loss = -F.logsigmoid(ratio)
    nll = -policy_chosen_logps.float() / chosen_lengths.float()  # unclamped: the true NLL
    losses = nll + beta * or_loss
    cr, rj = (beta * chosen).detach(), (beta * rejected).detach()
    metrics = {
        "chosen_reward": cr,
        "rejected_reward": rj,
        "margin": cr - rj,
        "correct": pair_outcome(cr, rj),
        "ties": pair_tie(cr, rj),
        "log_odds_chosen": odds_c.detach(),
        "log_odds_rejected": odds_r.detach(),
        "log_odds_ratio": ratio.detach(),
        "or_loss": or_loss.detach(),
        "nll": nll.detach(),
    }
    return losses, metrics
