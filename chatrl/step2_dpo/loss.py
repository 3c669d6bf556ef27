"""Direct preference optimisation and its family: pure tensor functions, no model, no distributed code.

Notation (per preference pair ``(x, y_w, y_l)``, ``y_w`` chosen, ``y_l`` rejected):

* ``log π(y|x)`` is the summed log-probability of the answer tokens under the policy, ``log π_ref``
  the same under the frozen reference (:func:`answer_logps` defines both over full logits; training
  computes the same sums with the LM head on the answer positions only,
  :func:`chatrl.step2_dpo.batch.batch_answer_logps`);
* ``h = [log π(y_w|x) − log π_ref(y_w|x)] − [log π(y_l|x) − log π_ref(y_l|x)]``, the difference of
  the implicit rewards divided by ``β``.

Loss types (:data:`LOSS_TYPES`), per pair:

=========  ===================================================================  ==========================
``sigmoid``  ``−(1−ε) log σ(β h) − ε log σ(−β h)``                               Rafailov et al. 2023 eq. 7;
                                                                                 ``ε > 0``: conservative DPO
                                                                                 (Mitchell 2023, "cDPO")
``ipo``      ``(h̄ − 1/(2β))²``, ``h̄`` as ``h`` with each log-ratio divided by    Azar et al. 2023 eq. 17
             its answer's token count (the form the paper's results used, as
             TRL's authors confirmed with them; keeps β comparable across lengths)
``hinge``    ``max(0, 1 − β h)``                                                 SLiC, Zhao et al. 2023 eq. 3
``simpo``    ``−(1−ε) log σ(β Δ̄ − γ) − ε log σ(−(β Δ̄ − γ))`` with                  Meng et al. 2024 eq. 6;
             ``Δ̄ = log π(y_w|x)/|y_w| − log π(y_l|x)/|y_l|`` (no reference)         reference-free
=========  ===================================================================  ==========================

With ``rpo_alpha = α > 0`` every loss type gets an SFT term on the chosen answer, the per-token
negative log-likelihood ``α · (−log π(y_w|x) / |y_w|)`` (RPO: Pang et al. 2024, "Iterative Reasoning
Preference Optimization", eq. 1, with α on the NLL term as in its v3 and TRL's ``rpo_alpha``; the
paper also counts the prompt's tokens, chatrl scores the answer only). DPO's objective depends only
on the chosen-minus-rejected difference, so it is free to lower both answers' log-probs together
and with them the end-of-turn token both end with; the NLL term keeps the chosen answer, its EOS
included, likely (docs/dpo.md, "EOS after DPO").

The implicit rewards reported as metrics are ``β (log π − log π_ref)`` for the reference-based
losses and ``β log π / |y|`` for SimPO (its own reward, eq. 4 of the SimPO paper); the NLL term
does not change them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chatrl.config import setting

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo")
REFERENCE_FREE = ("simpo",)


def answer_logps(logits: torch.Tensor, input_ids: torch.Tensor, answer_mask: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability of each row's answer tokens, and how many there are.

    Args:
        logits: ``(N, T, V)``; position ``t`` predicts token ``t + 1``.
        input_ids: ``(N, T)`` long, the tokens the logits were computed from.
        answer_mask: ``(N, T)``, 1 on the answer tokens (EOS included), 0 on prompt tokens and pads.
            Position 0 is never scored (nothing predicts it).

    Returns:
        ``(logps (N,), n_tokens (N,))``: float32 sums of ``log p(token | tokens before it)`` (nats),
        and long counts. A row's value depends only on its own real tokens when the logits come
        from :func:`chatrl.models.causal_lm.causal_lm_logits` (positions from the mask), whatever the padding.

    Raises:
        ValueError: shapes disagree.
    """
    if logits.shape[:2] != input_ids.shape or input_ids.shape != answer_mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)}, input_ids {tuple(input_ids.shape)} and answer_mask "
                         f"{tuple(answer_mask.shape)} disagree on (N, T)")
    targets = input_ids[:, 1:]
    # One row at a time: a float32 (T, V) temporary instead of (N, T, V) (50k-token vocabularies).
    token_logp = torch.stack([
        torch.log_softmax(logits[i, :-1].float(), dim=-1).gather(-1, targets[i].unsqueeze(-1)).squeeze(-1)
        for i in range(logits.shape[0])])
    mask = answer_mask[:, 1:].to(token_logp.dtype)
    return (token_logp * mask).sum(-1), answer_mask[:, 1:].long().sum(-1)


@dataclass
class DPOConfig:
    """DPO's loss (DeepSpeed-Chat's names for ``--beta``, ``--label_smoothing``; TRL's for the others)."""

    beta: float = setting(0.1, "β: inverse temperature of the implicit reward β·log(π/π_ref); larger keeps the "
                               "policy closer to the reference")
    label_smoothing: float = setting(0.0, "ε in [0, 0.5): assumed share of flipped preference labels (conservative "
                                          "DPO; sigmoid and simpo losses)")
    loss_type: str = setting("sigmoid", "sigmoid: DPO; ipo: IPO (squared loss, target margin 1/(2β)); hinge: SLiC "
                                        "hinge; simpo: SimPO (reference-free, length-normalised log-probs)",
                             choices=LOSS_TYPES)
    simpo_gamma: float = setting(0.5, "γ: SimPO's target reward margin, in reward units (TRL's gamma_beta_ratio is "
                                      "γ/β)")
    rpo_alpha: float = setting(0.0, "α: weight of an SFT term on the chosen answer, α·(−log π(y_w|x)/|y_w|), "
                                    "added to each pair's loss (RPO, Pang et al. 2024; TRL's name); keeps the "
                                    "chosen answers and their EOS likely (docs/dpo.md). 0: plain DPO",
                               unit="loss weight")

    def __post_init__(self):
        """Check the values together.

        Raises:
            ValueError: naming the flag (an unknown loss, ``--beta <= 0``, ``--label_smoothing``
                outside ``[0, 0.5)`` or with a loss it does not apply to, a negative ``--rpo_alpha``).
        """
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"--loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if not self.beta > 0:
            raise ValueError(f"--beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "simpo"):
            raise ValueError(f"--label_smoothing applies to the sigmoid and simpo losses, not {self.loss_type}")
        if not self.rpo_alpha >= 0:
            raise ValueError(f"--rpo_alpha must be >= 0, got {self.rpo_alpha}")

    @property
    def reference_free(self) -> bool:
        """Whether the loss needs no reference model (SimPO)."""
        return self.loss_type in REFERENCE_FREE


def _smoothed_logsigmoid_loss(z: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def preference_loss(
    settings: DPOConfig,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
    chosen_len: torch.Tensor | None = None,
    rejected_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair loss and implicit rewards of ``settings.loss_type`` (formulas in the module docstring).

    Args:
        settings: β, ε, loss type, γ.
        policy_chosen, policy_rejected: ``(B,)`` summed answer log-probs under the policy (nats).
        ref_chosen, ref_rejected: ``(B,)`` the same under the reference; required unless SimPO.
        chosen_len, rejected_len: ``(B,)`` answer token counts; required by IPO and SimPO (length
            normalisation), ``chosen_len`` also when ``rpo_alpha > 0``; ignored otherwise.

    Returns:
        ``(losses (B,), chosen_rewards (B,), rejected_rewards (B,))`` in float32; the rewards are
        detached. Average ``losses`` over pairs for the training objective.

    Raises:
        ValueError: a required input is missing, or shapes disagree.
    """
    pc, pr = policy_chosen.float(), policy_rejected.float()
    if pc.shape != pr.shape or pc.ndim != 1:
        raise ValueError(f"policy log-probs must be two (B,) tensors, got {tuple(pc.shape)} and {tuple(pr.shape)}")
    beta, eps = settings.beta, settings.label_smoothing
    if settings.loss_type in ("simpo", "ipo") and (chosen_len is None or rejected_len is None):
        raise ValueError(f"the {settings.loss_type} loss needs the answers' token counts (length normalisation)")
    if settings.rpo_alpha and chosen_len is None:
        raise ValueError("--rpo_alpha needs the chosen answers' token counts (per-token NLL)")
    # RPO's SFT term (module docstring): α times the chosen answer's mean per-token NLL, 0 when α = 0.
    nll = -pc / chosen_len.clamp(min=1).to(pc) if settings.rpo_alpha else torch.zeros_like(pc)
    if settings.loss_type == "simpo":
        avg_c = pc / chosen_len.clamp(min=1).to(pc)
        avg_r = pr / rejected_len.clamp(min=1).to(pr)
        losses = _smoothed_logsigmoid_loss(beta * (avg_c - avg_r) - settings.simpo_gamma, eps)
        return losses + settings.rpo_alpha * nll, (beta * avg_c).detach(), (beta * avg_r).detach()
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"the {settings.loss_type} loss needs the reference model's log-probs")
    rc, rr = ref_chosen.float().to(pc.device), ref_rejected.float().to(pc.device)
    if rc.shape != pc.shape or rr.shape != pc.shape:
        raise ValueError(f"reference log-probs {tuple(rc.shape)}, {tuple(rr.shape)} and policy log-probs "
                         f"{tuple(pc.shape)} disagree")
    h = (pc - rc) - (pr - rr)
    if settings.loss_type == "sigmoid":
        losses = _smoothed_logsigmoid_loss(beta * h, eps)
    elif settings.loss_type == "ipo":
        h_avg = (pc - rc) / chosen_len.clamp(min=1).to(pc) - (pr - rr) / rejected_len.clamp(min=1).to(pr)
        losses = (h_avg - 1.0 / (2.0 * beta)) ** 2
    else:  # hinge
        losses = torch.relu(1.0 - beta * h)
    return losses + settings.rpo_alpha * nll, (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()


def reward_stats(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over pairs (float64 scalars) for the ``rewards/*`` metrics: ``count``, ``correct``
    (pairs with chosen reward strictly above rejected; ties are wrong), ``chosen``, ``rejected``,
    ``margin``. Divide by ``count`` (after summing over ranks) for the means."""
    c, r = chosen_rewards.detach().double(), rejected_rewards.detach().double()
    return {"count": torch.tensor(float(c.numel()), dtype=torch.float64), "correct": (c > r).double().sum(),
            "chosen": c.sum(), "rejected": r.sum(), "margin": (c - r).sum()}
