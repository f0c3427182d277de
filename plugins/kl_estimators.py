"""Built-in KL estimators (Schulman, "Approximating KL divergence", 2020).

With x = log pi(y_t) - log pi_ref(y_t) at the sampled token y_t ~ pi, each returns a
per-token tensor (batch, response_len) whose expectation under pi relates to
KL(pi || pi_ref) at that position.

Straight-through estimators, for the KL-as-loss path (``kl_penalty: loss``), have the VALUE of
one estimator and the GRADIENT of another:

    st(a, b) = a.detach() + (b - b.detach())        value: a exactly (b - b is 0)    gradient: grad b

With s = grad log pi(y_t), the sampled-token estimators have, used as a loss on on-policy
samples, the expected gradients (pi_ref fixed, y_t held fixed):

    k1 = x                      grad = s                  E_pi[s]          = 0
    k2 = x^2 / 2                grad = x s                E_pi[x s]        = grad KL(pi || pi_ref)
    k3 = exp(-x) - 1 + x        grad = (1 - pi_ref/pi) s  E_pi[(1 - r) s]  = grad KL(pi_ref || pi)

(the last two: E_pi[x s] = sum_a grad pi(a) (log pi(a) - log pi_ref(a)) and sum_a grad pi(a) = 0;
E_pi[(1 - pi_ref/pi) s] = sum_a (grad pi(a) - pi_ref(a) grad log pi(a)) = -grad sum_a pi_ref log pi.)

So k3, the usual low-variance unbiased VALUE of the reverse KL (GRPO's ``low_var_kl``), has
the gradient of the FORWARD KL when differentiated as a loss: equal to the reverse-KL gradient
only to first order around pi = pi_ref, and biased further away (Tang & Munos, 2025, "On a few
pitfalls in KL divergence gradient estimation for RL"; verl's ``kl_loss_type: k3+``). k1 gives
no gradient at all in expectation. k2's value is biased, but its gradient x s is exactly the
score-function estimator of grad KL(pi || pi_ref). Hence:

    k3+  = st(k3, k2): reports k3's unbiased, non-negative value; trains with the reverse-KL gradient.
    k1+  = st(k1, k2): k1's unbiased (signed) value; the same gradient.

What "the gradient of KL" means here: at each sampled prefix s_t, grad KL(pi(.|s_t) || pi_ref(.|s_t))
with the prefix held fixed, the gradient of the ``full`` estimator used as the same loss. The
score-function term for how the prefix distribution itself moves is not in any loss-path
estimator; that part comes from k1 in the reward (``kl_penalty: reward`` or ``both``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lightning.checks import require
from rlhf_lightning.interfaces import KLEstimator, Truncation
from rlhf_lightning.registry import register, registry


@register("kl_estimator", "k1", description="x = log pi - log pi_ref: unbiased, high variance, can be negative")
class K1(KLEstimator):
    """k1 = x. Unbiased for KL(pi || pi_ref); single tokens can be negative."""

    unbiased_as_reward = True
    unbiased_value = True
    score_baseline = 1.0  # weighted in the loss: w k1 s, not w (k1 + 1) s (KLEstimator.score_baseline)

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, logits=None, ref_logits=None) -> Tensor:
        return logprobs - ref_logprobs


@register("kl_estimator", "abs", description="|x|: non-negative, biased upward")
class AbsKL(KLEstimator):
    """|x|. Non-negative; an upper bound in expectation on k1."""

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, logits=None, ref_logits=None) -> Tensor:
        return (logprobs - ref_logprobs).abs()


@register("kl_estimator", "k2", aliases=("mse",), description="x^2 / 2: non-negative, low variance, biased")
class K2(KLEstimator):
    """k2 = x^2 / 2. Non-negative, low variance; its gradient is that of the reverse-KL surrogate."""

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, logits=None, ref_logits=None) -> Tensor:
        return 0.5 * (logprobs - ref_logprobs) ** 2


@register("kl_estimator", "k3", aliases=("low_var_kl",), description="exp(-x) - 1 + x: unbiased, non-negative, low variance")
class K3(KLEstimator):
    """k3 = exp(-x) - 1 + x = (r - 1) - log r with r = pi_ref / pi. Unbiased and >= 0."""

    unbiased_value = True

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, logits=None, ref_logits=None) -> Tensor:
        x = logprobs - ref_logprobs
        return (-x).exp() - 1.0 + x


@register("kl_estimator", "full", description="exact KL over the whole vocabulary at each position, from both models' logits")
class FullKL(KLEstimator):
    """sum_a pi(a) (log pi(a) - log pi_ref(a)) at each position: exact, no sampling noise."""

    needs_logits = True
    unbiased_value = True  # exact: the KL itself

    def __call__(
        self, logprobs: Tensor, ref_logprobs: Tensor, logits: Optional[Tensor] = None, ref_logits: Optional[Tensor] = None
    ) -> Tensor:
        if logits is None or ref_logits is None:
            raise ValueError("the 'full' KL estimator needs the logits of both the policy and the reference")
        logp = F.log_softmax(logits.float(), dim=-1)
        ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
        return (logp.exp() * (logp - ref_logp)).sum(-1)


def straight_through(value: Tensor, gradient: Tensor) -> Tensor:
    """``value`` in the forward pass, the gradient of ``gradient`` in the backward pass."""
    return value.detach() + (gradient - gradient.detach())


@register("kl_estimator", "straight_through", description="value of one registered estimator, gradient of another")
class StraightThroughKL(KLEstimator):
    """st(value, gradient): the per-token value of the registered estimator ``value`` with the
    gradient of the registered estimator ``gradient``; for any pair, e.g. ``value: full, gradient: k2``.
    Two pairs are registered presets:

    - ``k3+`` = st(k3, k2): value exp(-x) - 1 + x, gradient x grad log pi(y_t), whose on-policy
      mean is grad KL(pi || pi_ref) (plain k3's is grad KL(pi_ref || pi)).
    - ``k1+`` = st(k1, k2): value x, the same gradient; as a loss it trains like k3+ and logs the
      plain log-ratio.

    Args:
        value: name of the estimator whose per-token value is returned.
        gradient: name of the estimator whose gradient flows back to the log-probs (and logits).
    """

    def __init__(self, value: str = "k3", gradient: str = "k2") -> None:
        kl = registry("kl_estimator")
        self.value_estimator, self.gradient_estimator = kl.create(value), kl.create(gradient)
        self.needs_logits = self.value_estimator.needs_logits or self.gradient_estimator.needs_logits
        self.unbiased_value = self.value_estimator.unbiased_value

    def __call__(
        self, logprobs: Tensor, ref_logprobs: Tensor, logits: Optional[Tensor] = None, ref_logits: Optional[Tensor] = None
    ) -> Tensor:
        return straight_through(
            self.value_estimator(logprobs, ref_logprobs, logits, ref_logits),
            self.gradient_estimator(logprobs, ref_logprobs, logits, ref_logits),
        )


# The straight-through presets: (aliases, value estimator, description); the gradient is k2's in both.
STRAIGHT_THROUGH_PRESETS = {
    "k3+": (("k3+k2", "low_var_kl+"), "k3", "value of k3, gradient of k2 (straight-through): unbiased reverse-KL gradient as a loss"),
    "k1+": (("k1+k2",), "k1", "value of k1, gradient of k2 (straight-through): unbiased value and reverse-KL gradient"),
}
for _name, (_aliases, _value, _description) in STRAIGHT_THROUGH_PRESETS.items():
    registry("kl_estimator").register(_name, StraightThroughKL, _description, _aliases, init_args={"value": _value, "gradient": "k2"})


@dataclass(frozen=True)
class TopKSignal:
    """The teacher's signal at each position when only its top k is kept: what a teacher server sends per token, and
    what the rollout keeps in place of the teacher's (batch, len, V) logits for a teacher's top k
    (:meth:`TopKKL.reference_signal`). k log-probabilities and k token ids (+ the tail's log-mass):
    :func:`signal_bytes_per_token` bytes, against V floats for the whole distribution. Enough for every truncation of
    the teacher's top k (``of: teacher``); the student's top k needs the teacher's log-probabilities at tokens known
    only once the student's logits are (verl#6676): the whole distribution."""

    logprobs: Tensor  # (..., k) log q of the teacher's top k, normalised over the whole vocabulary, descending
    indices: Tensor  # (..., k) their token ids
    tail: Tensor  # (...,) log(1 - Q_T), the log of the mass outside the top k: -inf where k >= V

    def __getitem__(self, rows) -> TopKSignal:
        """The signal of ``rows`` (a minibatch's), as ``ref_logits[rows]`` would be the logits'."""
        return TopKSignal(self.logprobs[rows], self.indices[rows], self.tail[rows])

    def nbytes(self) -> int:
        """The bytes its tensors hold."""
        return sum(t.numel() * t.element_size() for t in (self.logprobs, self.indices, self.tail))


def teacher_topk(ref_logits: Tensor, k: int) -> TopKSignal:
    """The teacher's top-k signal from its logits (..., V), in at least float32: the top k by logit (the same as by
    probability), their log-probabilities log q = logit - logsumexp(logits), and the rest's log-mass from the left-out
    logits themselves (accurate where the rest is a sliver of the mass, as 1 - Q_T in float32 would not be)."""
    ref_logits = ref_logits.to(torch.promote_types(ref_logits.dtype, torch.float32))
    log_z = ref_logits.logsumexp(-1, keepdim=True)
    top, indices = ref_logits.topk(min(k, ref_logits.shape[-1]), dim=-1)
    tail = ref_logits.scatter(-1, indices, -math.inf).logsumexp(-1) - log_z.squeeze(-1)
    return TopKSignal(top - log_z, indices, tail)


def signal_bytes_per_token(k: int, vocab: int, tail: bool = True, value_bytes: int = 4, index_bytes: int = 4) -> int:
    """Bytes of the teacher's signal per position: ``k`` values and ``k`` token ids (+ one value, the tail's log-mass,
    with ``tail``) where k < ``vocab``; the ``vocab`` values of the whole distribution, which need no ids, where k >= V.
    The wire's defaults: float32 values, int32 ids (a 49k vocabulary needs 16 bits; torch's ``topk`` returns int64)."""
    if k >= vocab:
        return vocab * value_bytes
    return k * (value_bytes + index_bytes) + (value_bytes if tail else 0)


def topk_kl(logits: Tensor, ref_logits: Union[Tensor, TopKSignal], truncation: Truncation) -> Tensor:
    """A KL summed over the top ``truncation.k`` tokens of one of the two distributions at each position.

    With p = softmax(logits) (the student), q = softmax(ref_logits) (the teacher), S the top k of q (``of:
    teacher``, a forward KL: weights w = q, other o = p) or of p (``of: student``, a reverse KL: w = p, o = q):

        plain         sum_S w log(w / o)                                 negative where o has more mass on S than w
        renormalise   sum_S w~ log(w~ / o~),  w~ = w / W_S, o~ = o / O_S   the KL of the two restrictions to S
        tail          sum_S w log(w / o) + (1 - W_S) log((1 - W_S) / (1 - O_S))   the KL of the (k+1)-symbol coarsenings
        generalised   sum_S [w log(w / o) - w + o]                       the generalised KL of unnormalised masses
        clamp         max(0, any of the above)

    W_S = sum_S w, O_S = sum_S o. S is chosen without gradient. (batch, len, V) logits -> (batch, len). With ``of:
    teacher`` ``ref_logits`` may be the teacher's :class:`TopKSignal` of this k instead (a server's, or one kept in place
    of the logits): the teacher's (batch, len, V) log-probabilities are never built, the same values either way.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # at least float32, float64 kept (the lab's)
    logp = F.log_softmax(logits.to(dtype), dim=-1)
    if truncation.of == "teacher":
        signal = ref_logits if isinstance(ref_logits, TopKSignal) else teacher_topk(ref_logits, truncation.k)
        index = signal.indices  # (batch, len, k)
        if index.shape[-1] != min(truncation.k, logp.shape[-1]):
            raise ValueError(f"a top-{truncation.k} KL got a teacher signal of {index.shape[-1]} tokens per position")
        lw, lo, tail_w = signal.logprobs.to(dtype), logp.gather(-1, index), signal.tail.to(dtype)
    else:
        if isinstance(ref_logits, TopKSignal):
            raise ValueError("the student's top k needs the teacher's logits there, not the teacher's top-k signal (verl#6676)")
        logq = F.log_softmax(ref_logits.to(dtype), dim=-1)
        index = logp.detach().topk(min(truncation.k, logp.shape[-1]), dim=-1).indices  # (batch, len, k)
        lw, lo = logp.gather(-1, index), logq.gather(-1, index)
        tail_w = logp.scatter(-1, index, -math.inf).logsumexp(-1) if truncation.tail else None
    if truncation.renormalise:
        lw, lo = lw - lw.logsumexp(-1, keepdim=True), lo - lo.logsumexp(-1, keepdim=True)
    terms = lw.exp() * (lw - lo)
    if truncation.generalised:
        terms = terms - lw.exp() + lo.exp()
    value = terms.sum(-1)
    if truncation.tail:
        log_other = logp if truncation.of == "teacher" else logq
        tail_o = log_other.scatter(-1, index, -math.inf).logsumexp(-1)
        empty = tail_w == -math.inf  # k >= V: nothing left out (0 log 0 = 0); kept finite for the gradient
        tail_w, tail_o = tail_w.masked_fill(empty, 0.0), tail_o.masked_fill(empty, 0.0)
        value = value + torch.where(empty, 0.0, tail_w.exp() * (tail_w - tail_o))
    return value.clamp_min(0.0) if truncation.clamp else value


@register("kl_estimator", "topk", description="a KL over the top k tokens of the teacher or the student (any truncation)")
class TopKKL(KLEstimator):
    """The KL over a top-k support (:func:`topk_kl`, docs/divergences.md, "Truncated support: top-k"): the teacher's
    top k (a forward KL, KL(pi_ref || pi) truncated) or the student's (a reverse KL, KL(pi || pi_ref) truncated),
    with a tail bucket, renormalised, clamped at 0 or as the generalised KL. Its class against the full-vocabulary
    KL of its direction, and the start-up warning where it is not exact: ``recipes.truncation_recipe``. Presets:

    - ``topk_forward``: sum over the teacher's top k of q log(q / p) (verl's ``forward_kl_topk`` without its clamp).
    - ``topk_forward_clamped``: the same, clamped at 0 (verl's ``forward_kl_topk``, verl#7856).
    - ``topk_forward_tail``: with the tail bucket (verl#7855's ``forward_kl_topk_tail``): exact at k >= V - 1.
    - ``topk_reverse``: KL of the student's and teacher's restrictions to the student's top k, both renormalised (OPD).
    - ``topk_reverse_clamped``: sum over the student's top k of p log(p / q), clamped at 0 (verl's ``reverse_kl_topk``).
    - ``topk_reverse_unnormalised``: the same sum, not clamped.
    - ``topk_generalised``: sum over the student's top k of p log(p / q) - p + q (MOPD's generalised KL).

    Args:
        k: tokens kept per position (all of them where k >= the vocabulary).
        of: whose top k: ``teacher`` (forward KL) or ``student`` (reverse KL).
        tail: add the mass outside the top k as one symbol.
        renormalise: renormalise both distributions on the top k.
        clamp: clamp the per-position sum at 0.
        generalised: the generalised KL of the unnormalised masses, sum w log(w / o) - w + o.
    """

    needs_logits = True

    def __init__(
        self,
        k: int = 64,
        of: str = "teacher",
        tail: bool = False,
        renormalise: bool = False,
        clamp: bool = False,
        generalised: bool = False,
    ) -> None:
        require(isinstance(k, int) and k >= 1, "kl_estimator.k", "an integer >= 1", k)
        require(of in ("teacher", "student"), "kl_estimator.of", "'teacher' or 'student'", of)
        require(not (renormalise and (tail or generalised)), "kl_estimator.renormalise", "false with tail or generalised", renormalise)
        require(not (tail and generalised), "kl_estimator.tail", "false with generalised", tail)
        self.truncation = Truncation(k, of, tail, renormalise, clamp, generalised)

    def __call__(
        self,
        logprobs: Tensor,
        ref_logprobs: Tensor,
        logits: Optional[Tensor] = None,
        ref_logits: Union[Tensor, TopKSignal, None] = None,
    ) -> Tensor:
        """The per-position value (batch, len); ``ref_logits``: the teacher's logits, or with ``of: teacher`` its
        :class:`TopKSignal` of this k (:func:`teacher_topk`)."""
        if logits is None or ref_logits is None:
            raise ValueError("a top-k KL estimator needs the logits of both the policy and the reference")
        return topk_kl(logits, ref_logits, self.truncation)

    def reference_signal(self, ref_logits: Tensor) -> Union[Tensor, TopKSignal]:
        """With the teacher's top k, its :class:`TopKSignal` (k x 12 + 4 bytes a position, not 4 V): all this estimator
        reads of the teacher. With the student's, the logits: its top k is known only in the update."""
        return teacher_topk(ref_logits, self.truncation.k) if self.truncation.of == "teacher" else ref_logits


# The top-k presets: name -> (init_args, description).
TOPK_PRESETS = {
    "topk_forward": ({"of": "teacher"}, "teacher's top-k forward KL, no tail: biased (negative where the student has more mass there)"),
    "topk_forward_clamped": ({"of": "teacher", "clamp": True}, "teacher's top-k forward KL clamped at 0 (verl's forward_kl_topk): biased"),
    "topk_forward_tail": (
        {"of": "teacher", "tail": True},
        "teacher's top-k forward KL with the rest as one symbol: approximate, exact at k >= V-1",
    ),
    "topk_reverse": ({"of": "student", "renormalise": True}, "student's top-k reverse KL, both renormalised: approximate, 0 at k = 1"),
    "topk_reverse_clamped": ({"of": "student", "clamp": True}, "student's top-k reverse KL clamped at 0 (verl's reverse_kl_topk): biased"),
    "topk_reverse_unnormalised": (
        {"of": "student"},
        "student's top-k reverse KL, not renormalised nor clamped: biased, lowered by spreading mass",
    ),
    "topk_generalised": ({"of": "student", "generalised": True}, "generalised KL on the student's top-k unnormalised mass (MOPD's)"),
}
for _name, (_args, _description) in TOPK_PRESETS.items():
    registry("kl_estimator").register(_name, TopKKL, _description, init_args=_args)
