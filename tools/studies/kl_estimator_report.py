"""Every registered KL estimator against the exact KL, on real samples: values and gradients.

    python -m tools.studies.kl_estimator_report                        # SmolLM2-135M, 64 samples of 32 tokens
    python -m tools.studies.kl_estimator_report --fast                 # the tiny random Llama (the tests)
    python -m tools.studies.kl_estimator_report --samples 128 --push 0.02 --out /tmp/kl

Setup. The reference is the model itself (``--policy``, default ``smollm2``); the policy is the
same weights plus a rank-8 LoRA adapter on every linear layer whose B matrices (zero at init) are
set to ``--push`` * N(0, 1) from a fixed seed: a RANDOM push, not a trained one, sized so that a
32-token response carries a few nats of KL (smollm2, push 0.05: about 2.7 nats; the tiny model,
whose LM head has no adapter, saturates near 0.6). ``--samples`` prompts from the built-in training set
are answered on-policy (y ~ pi, untruncated sampling) in batches of ``--batch-size``.

Values. At every sampled position the ``full`` estimator gives the exact KL(pi(.|s_t) || pi_ref(.|s_t))
over the whole vocabulary; its sum over a response is the exact per-sequence reference the
sampled-token estimators are compared with, on the same samples (each per-token estimator of an
unbiased kind has conditional mean exactly that term). Per estimator: bias = mean(estimate -
exact) per sequence with its standard error, the standard deviation of the per-sequence
estimate and of its error, the fraction of negative per-token values, and the cost per token
of the estimator call alone (minimum over repeats; ``full`` also needs both models' full
logits, 2 x vocab floats per token, where the others need two log-probs).

Gradients (the ``kl_penalty: loss`` use). Per batch, the loss is the estimator's masked token
mean, as in ``PPOUpdate.loss``, differentiated w.r.t. the LoRA parameters at the sampled
(on-policy) responses; the exact gradient is that of ``full`` used as the same loss. Reported:
cosine and relative norm error ||g - g_exact|| / ||g_exact|| of the gradients averaged over the
batches, and the spread of the per-batch gradients, sqrt(trace Cov) / ||g_exact||. The same cosine
and error again for the EXPECTED gradient over the sampled token, sum_a sg(pi(a)) grad est(x_a) at the
same states (exact over the vocabulary): this separates an estimator's bias as a loss (plain k3
follows grad KL(pi_ref || pi)) from the sampling noise that dominates the first two columns.

Off-policy (``kl_penalty: loss`` over several PPO epochs). Each batch is sampled from the pushed
policy pi_old, then the policy is moved ``--offpolicy-epochs`` PPO epochs away from it (clipped
surrogate with random +-1 advantages per response, Adam at ``--offpolicy-lr``, as an update driven by
a reward would move it) and put back after the batch. At the moved pi_theta, on the states sampled
from pi_old: the exact gradient of KL(pi_theta || pi_ref) (``full`` at pi_theta) against each
estimator's expected gradient with the token drawn from pi_old, sum_a sg(pi_old(a)) grad L(a), for
L = est (``kl_loss_weighting: none``) and L = w est with w = pi_theta / pi_old carrying gradient
(``importance``, ppo_math.importance_weighted_kl). Cosines: the corrected variants (value-unbiased
estimators weighted) at 1.000, the unweighted ones drifting with the distance moved.

Sequence level (``kl_penalty: loss`` for the whole response). The columns above compare each
position's gradient with grad KL(pi(.|s_t) || pi_ref(.|s_t)) at the same states: right per token. The
response's KL also charges each token for the KL of the states it leads to (ppo_math.kl_to_go_loss).
A second table measures that on an order-dependent tabular policy (rlhf_lightning/exact/tabular.py:
``--seq-tokens`` tokens, responses of ``--seq-length``, every response enumerated, so each expected
gradient is an exact finite sum): the cosine between each configuration's expected gradient and the exact
gradient of KL(pi_theta || pi_ref) of the response distribution, per token (weighting none or importance,
as PPORLHF builds the loss today) and with the sequence term added; on-policy and with pi_theta moved
from the sampler pi_old (several PPO epochs). The sequence-corrected value-unbiased estimators sit at 1.000
on-policy; the per-token configurations show how much of the response's gradient they miss.

Writes ``--out`` (default runs/kl_estimator_report/report.md) and ``kl_estimates.png`` next to it
(per-sequence estimate against exact, one marker per estimator); prints the table.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.data import BUILTIN_TRAIN, load_prompts
from rlhf_lightning.exact import tabular as tb
from rlhf_lightning.module import PPORLHF
from rlhf_lightning.registry import registry
from tools._cli_args import option_number, tool_parser

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "runs" / "kl_estimator_report" / "report.md"
DEFAULT_PUSH = {"smollm2": 0.05, "tiny": 0.5}  # smollm2: about 3 nats per 32-token response
FAST = dict(policy="tiny", samples=32)
OFFPOLICY_LR = {"smollm2": 1e-3, "tiny": 1e-2}
EXACT = "full"
ZERO_GRADIENT = 1e-3  # ||expected gradient|| / ||exact|| below this: a zero vector up to rounding (k1)
ROUNDING = 1e-5  # negative values of a non-negative estimator no larger than this are float32 rounding


@dataclass
class EstimatorRow:
    name: str
    bias: float  # mean over sequences of (summed estimate - summed exact KL), nats
    bias_se: float  # its standard error
    std: float  # std of the per-sequence estimate
    error_std: float  # std of (estimate - exact) per sequence
    negative: float  # fraction of per-token values < 0
    most_negative: float  # smallest per-token value (0 if none is negative)
    ns_per_token: float  # estimator call alone
    grad_cos: float  # cosine(mean gradient, exact mean gradient)
    grad_rel_err: float  # ||mean gradient - exact|| / ||exact||
    grad_spread: float  # sqrt(trace of the per-batch gradient covariance) / ||exact||
    expected_grad_cos: float  # the same two with the sampled token summed out exactly (NaN: not elementwise)
    expected_grad_rel_err: float
    expected_grad_norm: float  # ||expected gradient|| / ||exact||
    needs_logits: bool
    off_policy_cos: float = math.nan  # pi_theta moved by PPO epochs from the sampler: weighting none
    off_policy_cos_importance: float = math.nan  # ... and importance (ratio carries gradient)


# ---------------------------------------------------------------------- setup
def build_module(policy: str, max_new_tokens: int, push: float, seed: int) -> PPORLHF:
    """PPORLHF with a LoRA adapter whose B matrices are pushed randomly away from zero."""
    from rlhf_lightning_plugins.rewards.function import CallableReward

    torch.manual_seed(seed)  # the tiny model's weights and the sampler's seed base
    module = PPORLHF(
        policy=policy,
        lora=dict(rank=8),
        kl=dict(placement="loss"),
        ppo=dict(whiten_advantages=False),
        sampling=dict(max_new_tokens=max_new_tokens),
        critic="shared",
        kl_estimator=EXACT,
        seed=seed,
        reward_model=CallableReward(function="rlhf_lightning_plugins.rewards.toy:char_count"),  # unused
    )
    module.configure_model()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.policy.named_parameters():
            if "lora_B" in name:
                param.copy_(push * torch.randn(param.shape, generator=generator))
    return module.eval()


def lora_parameters(module: PPORLHF) -> list[Tensor]:
    return [p for name, p in module.policy.named_parameters() if "lora_" in name]


# ---------------------------------------------------------------------- measurement
class GradientStats:
    """Running sum of per-batch gradient vectors and of their squared norms."""

    def __init__(self) -> None:
        self.sum: Optional[Tensor] = None
        self.sq = 0.0  # sum over batches of ||g_b||^2
        self.n = 0

    def add(self, grad: Tensor) -> None:
        grad = grad.double()
        self.sum = grad if self.sum is None else self.sum + grad
        self.sq += float(grad @ grad)
        self.n += 1

    @property
    def mean(self) -> Tensor:
        return self.sum / self.n

    @property
    def variance(self) -> float:
        """Trace of the covariance of the per-batch gradients (unbiased over batches)."""
        mean = self.mean
        return max(self.sq - self.n * float(mean @ mean), 0.0) / max(self.n - 1, 1)


class Accumulator:
    """One estimator's per-sequence and per-token values, timings and gradients over the batches."""

    def __init__(self) -> None:
        self.seq: list[Tensor] = []  # (batch,) summed estimates, one tensor per batch
        self.negative = 0.0
        self.most_negative = 0.0
        self.tokens = 0.0
        self.seconds = 0.0
        self.positions = 0
        self.sampled = GradientStats()  # gradient at the sampled tokens: what training sees
        self.expected = GradientStats()  # the sampled token integrated out exactly, same states

    def add_values(self, kl: Tensor, mask: Tensor) -> None:
        self.seq.append((kl * mask).sum(-1).double())
        self.negative += float(((kl < 0) & mask.bool()).sum())
        self.most_negative = min(self.most_negative, float((kl * mask).min()))
        self.tokens += float(mask.sum())

    @property
    def per_sequence(self) -> Tensor:
        return torch.cat(self.seq)


def time_call(estimator, args: tuple, repeats: int) -> float:
    best = math.inf
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            estimator(*args)
            best = min(best, time.perf_counter() - start)
    return best


def flat_grad(loss: Tensor, params: list[Tensor]) -> Tensor:
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params, strict=True)])


def token_values(estimator, logp: Tensor, ref_logp: Tensor) -> Optional[Tensor]:
    """est(log pi(a), log pi_ref(a)) for every vocabulary entry a, from the full-vocabulary log-probs:
    (batch, response_len, vocab). None for an estimator that is not elementwise in the log-probs
    (it needs logits, or fails on them)."""
    if estimator.needs_logits:
        return None
    try:
        values = estimator(logp, ref_logp)
    except Exception:  # a third-party estimator that is not elementwise
        return None
    return values if values.shape == logp.shape else None


def expected_gradient(
    values: Tensor, logp: Tensor, mask: Tensor, params: list[Tensor], old_logp: Optional[Tensor] = None, weighted: bool = False
) -> Tensor:
    """The gradient of the masked mean of sum_a sg(pi_s(a)) L(a), L = ``values`` (per vocabulary entry):
    the expected gradient with the token summed out exactly at the sampled states. pi_s is the policy
    ``logp`` itself (on-policy) or, given ``old_logp``, the sampler pi_old; ``weighted`` makes L the
    importance-weighted w_a values(a) of PPORLHF's ``kl_loss_weighting: importance`` (w carries gradient)."""
    sampler = logp if old_logp is None else old_logp
    if weighted:
        values = pm.importance_weighted_kl(values, logp, sampler, mask.unsqueeze(-1).expand_as(values))
    return flat_grad(pm.masked_mean((sampler.detach().exp() * values).sum(-1), mask), params)


def measure(module: PPORLHF, estimators: dict, prompts: Sequence[str], batch_size: int, repeats: int) -> dict:
    """Sample every batch once; accumulate values, timings and LoRA gradients for every estimator."""
    params = lora_parameters(module)
    acc = {name: Accumulator() for name in estimators}
    for b, start in enumerate(range(0, len(prompts), batch_size)):
        module.iteration = b  # rollout seeds its sampler from the iteration: a fresh draw per batch
        rollout = module.rollout(list(prompts[start : start + batch_size]))
        mask = rollout.response_mask.float()
        response_len = rollout.responses.shape[1]
        # The same forward pass with gradients, as PPOUpdate.loss does (on-policy: pi = pi_old).
        logits = module.networks.response_logits(module.policy, rollout.input_ids, rollout.attention_mask, response_len)
        logprobs = pm.logprobs_of(logits, rollout.responses)
        logp_all, ref_logp_all = logits.log_softmax(-1), rollout.ref_logits.log_softmax(-1)  # (batch, len, vocab)
        for name, estimator in estimators.items():
            args = (logprobs, rollout.ref_logprobs, logits, rollout.ref_logits)
            kl = estimator(*args)  # (batch, response_len)
            acc[name].add_values(kl.detach(), mask)
            acc[name].seconds += time_call(estimator, tuple(a.detach() for a in args), repeats)
            acc[name].positions += mask.numel()
            grad = flat_grad(pm.masked_mean(kl, mask), params)
            acc[name].sampled.add(grad)
            if name == EXACT:  # already the expectation over the token at each position
                acc[name].expected.add(grad)
            elif (values := token_values(estimator, logp_all, ref_logp_all)) is not None:
                acc[name].expected.add(expected_gradient(values, logp_all, mask, params))
        del logits, logprobs, logp_all, ref_logp_all
    return acc


def move_policy(module: PPORLHF, rollout, epochs: int, lr: float, seed: int) -> float:
    """``epochs`` PPO epochs (one Adam step each) of the clipped surrogate with random +-1 advantages per
    response, away from pi_old = the policy that sampled ``rollout``; returns the mean
    |log pi_theta - log pi_old| per response token after them."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (rollout.response_mask.shape[0], 1), generator=generator).to(rollout.response_mask) * 2 - 1
    advantages = signs.expand_as(rollout.response_mask)
    optimizer = torch.optim.Adam(lora_parameters(module), lr=lr)

    def logprobs() -> Tensor:
        logits = module.networks.response_logits(module.policy, rollout.input_ids, rollout.attention_mask, rollout.responses.shape[1])
        return pm.logprobs_of(logits, rollout.responses)

    for _ in range(epochs):
        optimizer.zero_grad()
        loss, _ = module.policy_loss(logprobs(), rollout.old_logprobs, advantages, rollout.response_mask)
        pm.masked_mean(loss, rollout.response_mask).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        return float(pm.masked_mean((logprobs() - rollout.old_logprobs).abs(), rollout.response_mask))


def measure_off_policy(module: PPORLHF, estimators: dict, prompts: Sequence[str], batch_size: int, epochs: int, lr: float) -> dict:
    """Per batch: sample from pi_old, move the policy ``epochs`` PPO epochs, and accumulate at pi_theta the
    exact gradient of KL(pi_theta || pi_ref) (key ``exact``) and each estimator's expected gradient
    under pi_old's tokens, unweighted and importance weighted (keys ``(name, weighting)``), plus the
    mean |log ratio| per batch (``moved``); the policy is restored after each batch."""
    params = lora_parameters(module)
    saved = [p.detach().clone() for p in params]
    out: dict = {"exact": GradientStats(), "moved": []}
    for b, start in enumerate(range(0, len(prompts), batch_size)):
        module.iteration = b
        rollout = module.rollout(list(prompts[start : start + batch_size]))  # sampled from pi_old
        mask = rollout.response_mask.float()
        with torch.enable_grad():
            out["moved"].append(move_policy(module, rollout, epochs, lr, seed=b))
        logits = module.networks.response_logits(module.policy, rollout.input_ids, rollout.attention_mask, rollout.responses.shape[1])
        logp, ref_logp, old_logp = logits.log_softmax(-1), rollout.ref_logits.log_softmax(-1), rollout.old_logits.log_softmax(-1)
        exact = estimators[EXACT](None, None, logits, rollout.ref_logits)  # (batch, response_len)
        out["exact"].add(flat_grad(pm.masked_mean(exact, mask), params))
        for name, estimator in estimators.items():
            # full's value is the same whichever token is drawn: one copy per vocabulary entry
            values = exact.unsqueeze(-1).expand_as(logp) if name == EXACT else token_values(estimator, logp, ref_logp)
            if values is None:
                continue
            for weighting in ("none", "importance"):
                grad = expected_gradient(values, logp, mask, params, old_logp, weighted=weighting == "importance")
                out.setdefault((name, weighting), GradientStats()).add(grad)
        with torch.no_grad():
            for param, value in zip(params, saved, strict=True):
                param.copy_(value)
    return out


SEQUENCE_COLUMNS = {  # column: (kl_loss_weighting, with the sequence term, tokens from pi_old != pi_theta)
    "none": ("none", False, False),
    "none + seq": ("none", True, False),
    "importance": ("importance", False, False),
    "importance + seq": ("importance", True, False),
    "off-policy importance": ("importance", False, True),
    "off-policy importance + seq": ("importance", True, True),
}


def sequence_level(estimators: dict, num_tokens: int = 4, length: int = 4, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per estimator and configuration (:data:`SEQUENCE_COLUMNS`), the cosine between the expected gradient
    of the KL loss and the exact grad KL(pi_theta || pi_ref) of the whole response, on the tabular
    ``tabular.order_dependent_tables``. ``importance`` is ``ppo_math.importance_weighted_kl`` with its ratio
    carrying gradient on estimators that read the sampled token (none on ``full``, as PPORLHF); ``+ seq``
    adds ``ppo_math.kl_to_go_loss`` on the estimator's values; ``off-policy``: tokens from pi_old != pi_theta.
    NaN where an estimator cannot be evaluated on the table (not elementwise and no logits path)."""
    ref, theta, old = tb.order_dependent_tables(num_tokens, length, seed)
    responses = tb.enumerate_responses(num_tokens, length)
    ref_logits, ref_logprobs = tb.position_logits(ref, responses), tb.token_logprobs(ref, responses)
    exact = tb.flatten(torch.autograd.grad(tb.sequence_kl(tb.token_logprobs(theta, responses), ref_logprobs), theta))

    def loss_fn(estimator, weighting: str, sequence: bool):
        def loss(logprobs, old_logprobs, logits):
            mask = torch.ones_like(logprobs)
            kl = estimator(logprobs, ref_logprobs, logits, ref_logits).to(logprobs.dtype)
            per_token = kl
            if weighting == "importance" and estimator.reads_sampled_token():
                per_token = pm.importance_weighted_kl(kl, logprobs, old_logprobs, mask)
            return per_token + pm.kl_to_go_loss(logprobs, old_logprobs, kl, mask) if sequence else per_token

        return loss

    rows = {}
    for name, estimator in estimators.items():
        row = {}
        for column, (weighting, sequence, off_policy) in SEQUENCE_COLUMNS.items():
            try:
                grad = tb.expected_gradient(loss_fn(estimator, weighting, sequence), theta, responses, old if off_policy else None)
            except Exception:  # a third-party estimator that cannot run on the table
                row[column] = math.nan
                continue
            row[column] = tb.cosine(tb.flatten(grad), exact)
        rows[name] = row
    return rows


def summarise(acc: dict, estimators: dict, off_policy: dict) -> list[EstimatorRow]:
    exact = acc[EXACT]
    exact_seq, exact_grad = exact.per_sequence, exact.sampled.mean
    exact_norm = float(exact_grad.norm())

    def compare(grad: Tensor) -> tuple[float, float]:
        """(cosine, relative norm error) of ``grad`` against the exact mean gradient."""
        return _cosine(grad, exact_grad), float((grad - exact_grad).norm()) / exact_norm

    rows = []
    for name, a in acc.items():
        seq = a.per_sequence
        err = seq - exact_seq
        n = seq.numel()
        grad_cos, grad_rel_err = compare(a.sampled.mean)
        expected_cos, expected_rel_err = compare(a.expected.mean) if a.expected.n else (math.nan, math.nan)
        expected_norm = float(a.expected.mean.norm()) / exact_norm if a.expected.n else math.nan
        off_cos = {
            w: _cosine(off_policy[(name, w)].mean, off_policy["exact"].mean) if (name, w) in off_policy else math.nan
            for w in ("none", "importance")
        }
        rows.append(
            EstimatorRow(
                name=name,
                bias=float(err.mean()),
                bias_se=float(err.std()) / math.sqrt(n),
                std=float(seq.std()),
                error_std=float(err.std()),
                negative=a.negative / max(a.tokens, 1.0),
                most_negative=a.most_negative,
                ns_per_token=1e9 * a.seconds / max(a.positions, 1),
                grad_cos=grad_cos,
                grad_rel_err=grad_rel_err,
                grad_spread=math.sqrt(a.sampled.variance) / exact_norm,
                expected_grad_cos=expected_cos,
                expected_grad_rel_err=expected_rel_err,
                expected_grad_norm=expected_norm,
                needs_logits=estimators[name].needs_logits,
                off_policy_cos=off_cos["none"],
                off_policy_cos_importance=off_cos["importance"],
            )
        )
    return rows


def _cosine(a: Tensor, b: Tensor) -> float:
    return float(a @ b) / max(float(a.norm()) * float(b.norm()), 1e-300)


# ---------------------------------------------------------------------- output
def format_report(rows: Sequence[EstimatorRow], exact_seq: Tensor, setup: dict) -> str:
    lines = [
        f"KL estimators against the exact full-vocabulary KL: reference `{setup['policy']}`, policy = reference + "
        f"rank-8 LoRA with B ~ {setup['push']:g} * N(0, 1) (random push, seed {setup['seed']}); "
        f"{setup['samples']} on-policy samples of up to {setup['max_new_tokens']} tokens in batches of "
        f"{setup['batch_size']}, {setup['tokens']} response tokens.",
        f"Exact KL per sequence: mean {float(exact_seq.mean()):.3f}, std {float(exact_seq.std()):.3f} nats "
        f"({setup['kl_per_token']:.4f} per token). Gradients: w.r.t. {setup['lora_params']:,} LoRA parameters "
        f"of the masked token-mean loss, {setup['batches']} batches. Wall time {setup['wall_s']:.0f} s.",
        "",
        "| estimator | bias (nats/seq) | ± s.e. | std of estimate | std of error | negative tokens "
        "| ns / token | grad cosine | grad rel. error | batch-grad spread | E-grad cosine | E-grad rel. error "
        "| off-policy E-grad cosine, none | off-policy, importance |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name}{' (needs both logits)' if r.needs_logits else ''} | {r.bias:+.3f} | {r.bias_se:.3f} "
            f"| {r.std:.3f} | {r.error_std:.3f} | {r.negative:.1%} | {r.ns_per_token:.3g} | {r.grad_cos:.3f} "
            f"| {r.grad_rel_err:.3f} | {r.grad_spread:.3f} "
            f"| {'zero' if r.expected_grad_norm < ZERO_GRADIENT else _num(r.expected_grad_cos)} "
            f"| {_num(r.expected_grad_rel_err)} | {_num(r.off_policy_cos)} | {_num(r.off_policy_cos_importance)} |"
        )
    lines += [
        "",
        "bias, std: per-sequence sums of the per-token values over the response mask, against the exact sum on the "
        "same samples. ns / token: the estimator call alone per response position (minimum over repeats); `full` "
        "also needs both models' logits over the whole vocabulary at every position. grad cosine / rel. error: the "
        "batch-averaged gradient of the estimator used as a loss (`kl_penalty: loss`) against that of `full`, the "
        "exact per-position KL. batch-grad spread: sqrt(trace of the covariance of the per-batch gradients) / "
        "||exact gradient||. E-grad: the same comparison for the gradient with the sampled token summed out "
        "exactly, sum_a sg(pi(a)) grad est(x_a) at the same states: the estimator's bias as a loss, without the "
        f"sampling noise (n/a: not elementwise in the log-probs; zero: the expected gradient's norm is below "
        f"{ZERO_GRADIENT:g} of the exact one, its direction is rounding noise).",
        f"off-policy: the policy moved {setup['offpolicy_epochs']} PPO epochs (Adam, lr {setup['offpolicy_lr']:g}, random "
        f"+-1 advantages) from the sampler, mean |log pi_theta - log pi_old| = {setup['moved']:.3f} per token; cosine of "
        "the expected gradient with tokens from pi_old, unweighted (`kl_loss_weighting: none`) or importance weighted "
        "(`importance`, w = pi_theta / pi_old with gradient), to the exact gradient of KL(pi_theta || pi_ref).",
    ]
    for r in rows:
        if r.negative and r.most_negative > -ROUNDING:
            lines.append(
                f"{r.name}: its negative values ({r.negative:.1%} of tokens, none below {r.most_negative:.1e}) are "
                "float32 rounding at x = log pi - log pi_ref near 0 (cancellation in the formula), not estimates."
            )
    return "\n".join(lines)


def format_sequence_table(rows: dict[str, dict[str, float]], num_tokens: int, length: int, seed: int) -> str:
    """The sequence-level table of :func:`sequence_level`."""
    lines = [
        f"Sequence level: cosine of each configuration's expected gradient to the exact gradient of KL(pi_theta || pi_ref) of "
        f"the whole response, on an order-dependent tabular policy ({num_tokens} tokens, responses of {length}, all "
        f"{num_tokens**length} enumerated, seed {seed}; tabular.order_dependent_tables). `+ seq`: with the sequence term "
        "(ppo_math.kl_to_go_loss); off-policy: tokens from pi_old, pi_theta moved from it as by a few PPO epochs.",
        "",
        "| estimator | " + " | ".join(SEQUENCE_COLUMNS) + " |",
        "|---|" + "---:|" * len(SEQUENCE_COLUMNS),
    ]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join(_num(row[c]) for c in SEQUENCE_COLUMNS) + " |")
    lines += [
        "",
        "Per token (no `+ seq`), every estimator misses the KL each token causes later in the response. With the term, the "
        "configurations whose per-token part is right and whose VALUE is unbiased (k1, k3 importance; full; k1+, k3+ "
        "unweighted) are exact on-policy; off-policy they keep PPO's approximation of the visited states (pi_old's, not "
        "pi_theta's). k2's value is biased, so its term is the score term of another quantity.",
    ]
    return "\n".join(lines)


def _num(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def plot(acc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exact = acc[EXACT].per_sequence.numpy()
    markers = "o^sDv<>phx*+"
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    for i, (name, a) in enumerate(acc.items()):
        ax.scatter(exact, a.per_sequence.numpy(), marker=markers[i % len(markers)], s=22, alpha=0.7, label=name)
    lo, hi = ax.get_xlim()
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="y = x")
    ax.set_xlabel("exact KL of the sequence (sum over positions, nats)")
    ax.set_ylabel("estimate (nats)")
    ax.set_title("Per-sequence KL estimates against the exact KL")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--policy", default=None, help="model spec of the reference (default smollm2; --fast: tiny)")
    parser.add_argument(
        "--samples", type=option_number(integer=True, at_least=1), default=None, help="responses to sample (default 64; --fast 32)"
    )
    parser.add_argument("--batch-size", type=option_number(integer=True, at_least=1), default=16)
    parser.add_argument("--max-new-tokens", type=option_number(integer=True, at_least=1), default=32)
    parser.add_argument("--push", type=option_number(above=0), default=None, help=f"std of the LoRA B matrices (default {DEFAULT_PUSH})")
    parser.add_argument("--estimators", nargs="*", default=None, help="default: every registered kl_estimator")
    parser.add_argument("--seed", type=option_number(integer=True), default=0)
    parser.add_argument("--repeats", type=option_number(integer=True, at_least=1), default=5, help="timing repeats per estimator call")
    parser.add_argument("--threads", type=option_number(integer=True, at_least=1), default=1, help="torch threads (default 1)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="markdown report path; the PNG goes next to it")
    parser.add_argument("--fast", action="store_true", help="tiny model, 32 samples (seconds)")
    parser.add_argument(
        "--offpolicy-epochs", type=option_number(integer=True, at_least=1), default=4, help="PPO epochs the policy moves from the sampler"
    )
    parser.add_argument(
        "--offpolicy-lr", type=option_number(above=0), default=None, help=f"their Adam learning rate (default {OFFPOLICY_LR})"
    )
    parser.add_argument(
        "--seq-tokens",
        type=option_number(integer=True, at_least=2),
        default=4,
        help="tokens of the sequence-level tabular policy (default 4)",
    )
    parser.add_argument("--seq-length", type=option_number(integer=True, at_least=1), default=4, help="its response length (default 4)")
    args = parser.parse_args(argv)
    defaults = dict(FAST) if args.fast else dict(policy="smollm2", samples=64)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.push is None:
        args.push = DEFAULT_PUSH.get(args.policy, DEFAULT_PUSH["smollm2"])
    if args.offpolicy_lr is None:
        args.offpolicy_lr = OFFPOLICY_LR.get(args.policy, OFFPOLICY_LR["smollm2"])
    return args


def main(argv: Optional[Sequence[str]] = None) -> list[EstimatorRow]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return report(args)
    finally:
        torch.set_num_threads(threads)


def report(args: argparse.Namespace) -> list[EstimatorRow]:
    started = time.perf_counter()
    kl = registry("kl_estimator")
    names = args.estimators or [entry.name for entry in kl.entries()]
    names = [name for name in names if kl.get(name) is not kl.get(EXACT)] + [EXACT]  # the reference, last
    estimators = {name: kl.create(name) for name in dict.fromkeys(names)}  # a preset (k1+) with its arguments

    module = build_module(args.policy, args.max_new_tokens, args.push, args.seed)
    pool = load_prompts(BUILTIN_TRAIN)
    prompts = [pool[i % len(pool)] for i in range(args.samples)]
    acc = measure(module, estimators, prompts, args.batch_size, args.repeats)
    off_policy = measure_off_policy(module, estimators, prompts, args.batch_size, args.offpolicy_epochs, args.offpolicy_lr)
    rows = summarise(acc, estimators, off_policy)

    exact_seq = acc[EXACT].per_sequence
    tokens = int(acc[EXACT].tokens)
    setup = dict(
        policy=args.policy,
        push=args.push,
        seed=args.seed,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        tokens=tokens,
        kl_per_token=float(exact_seq.sum()) / tokens,
        lora_params=sum(p.numel() for p in lora_parameters(module)),
        batches=acc[EXACT].sampled.n,
        wall_s=time.perf_counter() - started,
        offpolicy_epochs=args.offpolicy_epochs,
        offpolicy_lr=args.offpolicy_lr,
        moved=sum(off_policy["moved"]) / len(off_policy["moved"]),
    )
    sequence = sequence_level(estimators, args.seq_tokens, args.seq_length, args.seed)
    text = format_report(rows, exact_seq, setup) + "\n\n" + format_sequence_table(sequence, args.seq_tokens, args.seq_length, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    plot(acc, out.parent / "kl_estimates.png")
    print(text)
    print(f"\nwrote {out} and {out.parent / 'kl_estimates.png'}")
    return rows


if __name__ == "__main__":
    main()
