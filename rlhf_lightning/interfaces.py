"""The plugin contracts: one abstract base class per plugin kind.

These are plain ABCs (not ``typing.Protocol``) so that jsonargparse can resolve
``class_path: K3`` among their imported subclasses. Implementations live in
``plugins/`` (importable as ``rlhf_lightning_plugins``) or in third-party packages.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from rlhf_lightning.checks import FLOAT32_RANGE, ConfigError, ConfigFileNotFoundError, finite_number, require, require_number  # noqa: F401 (re-exported)
from rlhf_lightning.registry import register_kind
from rlhf_lightning.reward_shaping import ScoreShaping, check_scores

KLUnit = Literal["sequence_sum", "token_mean"]


class Plugin(ABC):
    """The base of every plugin kind: records the arguments an instance was built with,
    ``init_args`` (defaults filled in), however it was built (a short name, a ``class_path``, a
    test's constructor call). A checkpoint stores them and a resume compares them with the
    config's (``checkpoints.check_compatible``), so a changed plugin argument is logged."""

    init_args: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls.__init__ is object.__init__ and (args or kwargs):  # object.__init__ would swallow them: __new__ is ours
            raise TypeError(f"{cls.__name__}() takes no arguments, got {', '.join([*map(repr, args), *kwargs])}")
        self = super().__new__(cls)
        try:
            bound = inspect.signature(cls.__init__).bind(self, *args, **kwargs)
        except TypeError:  # copy and pickle call __new__ without the arguments, then restore __dict__
            return self
        bound.apply_defaults()
        self.init_args = {}
        for name, value in list(bound.arguments.items())[1:]:
            kind = bound.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:  # **options: the base's arguments, by their names
                self.init_args.update(value)
            elif kind is not inspect.Parameter.VAR_POSITIONAL or value:
                self.init_args[name] = value
        return self


@dataclass(frozen=True)
class Truncation:
    """What a truncated-support KL estimator keeps of the vocabulary (``plugins/kl_estimators.TopKKL``), read by
    ``recipes.truncation_recipe``: the top ``k`` tokens of the ``teacher`` (pi_ref; a forward KL) or the ``student``
    (pi; a reverse KL), the rest's mass as one ``tail`` symbol, both restrictions ``renormalise``-d, the sum
    ``clamp``-ed at 0, or the ``generalised`` KL of the unnormalised masses (docs/divergences.md, "Truncated support")."""

    k: int
    of: Literal["teacher", "student"]
    tail: bool = False
    renormalise: bool = False
    clamp: bool = False
    generalised: bool = False


class KLEstimator(Plugin):
    """Per-token estimate of KL(pi || pi_ref) at the sampled tokens of a response.

    With x = logp_policy - logp_ref of each sampled token, an estimator returns a tensor
    of shape (batch, response_len); the caller masks out prompt and padding positions.
    Estimators that need whole distributions set ``needs_logits = True`` and then also
    receive the (temperature-scaled) logits of both models, shape (batch, response_len, vocab).
    """

    needs_logits: bool = False
    # True when the value is an unbiased estimate of the per-token KL at the sampled state
    # (E_{y_t ~ pi}[k_t] = KL(pi(.|s_t) || pi_ref(.|s_t))): k1, k3, full. Only then is the response's KL
    # the expected sum of the values, and the KL still to come (ppo_math.kl_to_go_loss) its score term.
    unbiased_value: bool = False
    # True when, as a per-token reward, its policy gradient (score function times return) is the
    # gradient of the KL: only the log-ratio k1 has this property.
    unbiased_as_reward: bool = False
    # A constant b that the importance-weighted loss subtracts as b * w_t in its gradient only (the
    # value is unchanged): E_old[grad w_t] = grad E_theta[1] = 0, so the mean gradient stays grad KL and
    # a score term carrying no signal goes. k1: grad(w k1) = w (k1 + 1) s; b = 1 leaves w k1 s, k3's.
    score_baseline: float = 0.0
    # Set by an estimator that sums over part of the vocabulary (a top-k): recipes.truncation_recipe classes it.
    truncation: Optional[Truncation] = None

    @abstractmethod
    def __call__(
        self,
        logprobs: Tensor,
        ref_logprobs: Tensor,
        logits: Optional[Tensor] = None,
        ref_logits: Optional[Tensor] = None,
    ) -> Tensor: ...

    def checked(
        self, logprobs: Tensor, ref_logprobs: Tensor, logits: Optional[Tensor] = None, ref_logits: Optional[Tensor] = None
    ) -> Tensor:
        """The estimate, refused (ConfigError naming the estimator) unless it is a floating-point
        tensor shaped like ``logprobs``: the loop masks and sums it as one."""
        kl = self(logprobs, ref_logprobs, logits, ref_logits)
        shape = tuple(logprobs.shape)
        got = f"{type(kl).__name__} {tuple(kl.shape)} {kl.dtype}" if isinstance(kl, Tensor) else type(kl).__name__
        require(
            isinstance(kl, Tensor) and tuple(kl.shape) == shape and kl.is_floating_point(),
            f"the output of KL estimator {type(self).__name__}",
            f"a floating-point tensor of shape (batch, response_len) = {shape}",
            got,
        )
        return kl

    def reference_signal(self, ref_logits: Tensor) -> Any:
        """What a rollout keeps of the reference's logits (batch, response_len, vocab) for this estimator, handed back
        as its ``ref_logits`` (rows of it as ``signal[rows]``): the logits themselves; an estimator that reads less
        keeps less (a teacher's top k: ``TopKKL``)."""
        return ref_logits

    def reads_sampled_token(self) -> bool:
        """Whether the value at a position changes with the token sampled there, probed with two
        different tokens under the same logits; false for ``full``, which sums over the vocabulary
        (and so takes no importance ratio). Estimators that read only the sampled token's
        log-probs are not probed (true)."""
        if not self.needs_logits:
            return True
        generator = torch.Generator().manual_seed(0)
        logits, ref_logits = torch.randn(2, 1, 3, 5, generator=generator, dtype=torch.float64)
        logps, ref_logps = logits.log_softmax(-1), ref_logits.log_softmax(-1)
        first, second = (self(logps[..., token], ref_logps[..., token], logits, ref_logits) for token in ([0, 1, 2], [3, 4, 0]))
        return not torch.allclose(first, second)

    def pathwise_gradient_unbiased(self) -> bool:
        """Whether differentiating the estimate itself gives the KL's gradient on-policy,
        E_{y ~ pi}[grad k] = grad KL(pi || pi_ref) per token: its autograd derivative in the
        log-ratio x is x (k2's, and the straight-through k3+'s and k1+'s), probed at x in [-2, 2].
        Estimators that need logits are not probed (false unless they ignore the sampled token)."""
        if self.needs_logits:
            return not self.reads_sampled_token()
        x = torch.linspace(-2.0, 2.0, 9, dtype=torch.float64).unsqueeze(0).requires_grad_()
        (grad,) = torch.autograd.grad(self(x, torch.zeros_like(x)).sum(), x)
        return torch.allclose(grad, x.detach(), atol=1e-6)

    def gradient_follows_value(self) -> bool:
        """Whether autograd through the estimator gives the derivative of its value, probed by
        central differences at log-ratios x in [-2, 2]; false for straight-through estimators
        (k3+, k1+), whose gradient is another estimator's. Estimators that need logits are not
        probed (true)."""
        if self.needs_logits:
            return True
        x = torch.linspace(-2.0, 2.0, 9, dtype=torch.float64).unsqueeze(0).requires_grad_()
        ref = torch.zeros_like(x)
        (grad,) = torch.autograd.grad(self(x, ref).sum(), x)
        h = 1e-6
        with torch.no_grad():
            derivative = (self(x + h, ref) - self(x - h, ref)) / (2 * h)
        return torch.allclose(grad, derivative, atol=1e-5)


class Divergence(Plugin):
    """The regulariser D_f(pi || pi_ref) = E_{y ~ pi_ref}[f(u(y))] with u(y) = pi(y|x) / pi_ref(y|x) and f
    convex, f(1) = 0 (docs/divergences.md). Every method takes log u, the response's summed per-token
    log-ratio (exact for the sampled response: the sequence's probability ratio), so u = exp(log u) is
    formed only where the formula needs it.

    Its gradient is a score function, grad D_f = sum_y pi_ref f'(u) grad u = E_pi[f'(u) grad log pi(y)]: PPO
    with the sequence-level penalty -beta f'(u(y)) added to the response's reward (at its last token) follows
    grad (E_pi r - beta D_f). Its value from the policy's own samples: D_f = E_pi[f(u) / u] (:meth:`value`).
    The optimum solves r(y) - beta f'(u(y)) = lambda(x) wherever u > 0: pi*(y) = pi_ref(y) (f')^{-1}((r(y) -
    lambda) / beta), clipped at u = 0 where (f')^{-1} would leave [0, inf), lambda set by normalisation
    (f-DPO, Wang et al. 2023; f-DPG, Go et al. 2023; ``exact.f_divergence.divergence_optimal_logprobs``).

    ``per_token``: True only for the reverse KL, whose f'(u) = log u + 1 is a sum over tokens plus a constant:
    its penalty is the KL estimator's per-token one (``model.kl_estimator``, ``model.kl.placement``), as it
    has always been. A sequence-level divergence (False) goes into the reward only, and the per-token
    settings that make no sense for it are refused at start-up (``args.check_divergence``).
    """

    per_token: bool = False

    @abstractmethod
    def f(self, log_u: Tensor) -> Tensor:
        """f(u), elementwise; its limit at u = 0 (log u = -inf)."""

    @abstractmethod
    def f_prime(self, log_u: Tensor) -> Tensor:
        """f'(u), elementwise: the sequence-level penalty per unit of beta."""

    @abstractmethod
    def log_f_prime_inverse(self, v: Tensor) -> Tensor:
        """log (f')^{-1}(v), elementwise: log of the u > 0 with f'(u) = v; -inf where v <= f'(0+) (u clipped to
        0: the response leaves the support), +inf where v >= sup f' (no finite u)."""

    def value(self, log_u: Tensor) -> Tensor:
        """f(u) / u of a response sampled from pi: E_pi[f(u) / u] = D_f(pi || pi_ref) (wherever pi_ref > 0 has pi > 0)."""
        return self.f(log_u) * torch.exp(-log_u)


class BetaController(Plugin):
    """Holds the KL coefficient beta and updates it from the observed KL after every iteration.

    ``unit`` declares which KL the controller sees and its target is expressed in:
    ``sequence_sum`` (batch mean of each response's summed per-token KL, as in
    lm-human-preferences and TRL) or ``token_mean`` (mean over all response tokens, as in
    verl and OpenRLHF). The observed value is always the global mean across ranks.

    Every controller answers the per-prompt questions, so the loop asks them whatever its kind: the beta
    of each prompt (:meth:`betas_of`), its KL budget (:meth:`budgets_of`), each prompt's KL after an
    iteration (:meth:`update_prompts`). A controller with one beta gives it for every prompt and ignores
    the prompts' KLs; :class:`PerPromptBetaController` keeps one per prompt.
    """

    keyed_by_prompt: bool = False
    """True where the controller keeps a beta per training prompt, named by the prompt file's ids: it needs
    them (and their budgets, :meth:`set_budgets`) at start-up, so its training batches must come from a prompt file."""

    def __init__(self, init_beta: float = 0.1, unit: KLUnit = "sequence_sum") -> None:
        require_number("beta_controller.init_beta", init_beta, at_least=0, at_most=FLOAT32_RANGE[1])
        require(
            init_beta == 0 or init_beta >= FLOAT32_RANGE[0],
            "beta_controller.init_beta",
            f"0 or at least {FLOAT32_RANGE[0]:g} (below, beta is 0 in the float32 reward: the regulariser vanishes unsaid)",
            init_beta,
        )
        require(unit in ("sequence_sum", "token_mean"), "beta_controller.unit", "'sequence_sum' or 'token_mean'", unit)
        self.beta = float(init_beta)
        self.unit = unit

    @abstractmethod
    def update(self, observed_kl: float, n_samples: int) -> float:
        """Update from this iteration's observed KL over ``n_samples`` responses; return the new beta."""

    def checked_beta(self) -> float:
        """``beta``, refused unless a finite number >= 0 (a plugin's output the loop relies on)."""
        require(
            finite_number(self.beta) and 0 <= self.beta <= FLOAT32_RANGE[1],
            f"the beta of beta controller {type(self).__name__}",
            f"a finite number in [0, {FLOAT32_RANGE[1]:g}] (float32's range: it multiplies the float32 KL)",
            self.beta,
        )
        return float(self.beta)

    def betas_of(self, prompt_ids: Sequence[str]) -> Tensor:
        """The beta of each prompt id (float64, (len(prompt_ids),)): here the one (checked) beta for every prompt."""
        return torch.full((len(prompt_ids),), self.checked_beta(), dtype=torch.float64)

    def checked_betas(self, prompt_ids: Sequence[str]) -> Tensor:
        """:meth:`betas_of`, refused unless each is a finite number >= 0 (a plugin's output the loop relies on)."""
        betas = self.betas_of(prompt_ids)
        require(
            bool(torch.isfinite(betas).all() and (betas >= 0).all() and (betas <= FLOAT32_RANGE[1]).all()),
            f"the betas of beta controller {type(self).__name__}",
            f"finite numbers in [0, {FLOAT32_RANGE[1]:g}] (float32's range: they multiply the float32 KL)",
            betas.tolist(),
        )
        return betas

    def budgets_of(self, prompt_ids: Sequence[str]) -> Optional[Tensor]:
        """The KL budget of each prompt id (float64, (len(prompt_ids),)), in ``unit``: here the controller's
        ``target`` for every prompt where it steers toward one, else None (no budget)."""
        target = getattr(self, "target", None)
        return None if target is None else torch.full((len(prompt_ids),), float(target), dtype=torch.float64)

    def set_budgets(self, budgets: Optional[dict[str, float]]) -> None:
        """Each prompt id's budget (the prompt file's ``budget_column``), at start-up: nothing to keep here."""

    def check_batch(self, responses: int, per_prompt: int, field: str) -> None:
        """At start-up: refuse (a ConfigError naming ``field``'s argument) steps that cannot work with iterations of
        ``responses`` responses in all, ``per_prompt`` of each prompt; here every step can."""

    def update_prompts(self, prompt_ids: Sequence[str], observed_kls: Tensor, n_samples: Tensor) -> None:
        """Each prompt's observed KL in ``unit`` over its ``n_samples`` responses this iteration (every rank's),
        after :meth:`update`: nothing to do here (the one beta moves in :meth:`update`)."""

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])


class PerPromptBetaController(BetaController):
    """A controller that keeps one beta per training prompt, each moved by that prompt's own KL toward
    its budget (docs/plugins.md, "Per-prompt KL budgets").

    Prompts are named by the data module's stable prompt ids (``data.PromptTable``: the ``data.id_column``
    value, else a hash of the text), so the table survives reshuffling, a changed batch size and a changed
    world size. ``budget_column`` names the prompt file's column of per-prompt budgets (in ``unit``); without
    it every prompt's budget is ``target``. ``beta`` is the beta of a prompt with no entry yet (never seen,
    or held out: validation), moved from the iteration's mean KL toward ``target`` (by :meth:`update`, or by
    :meth:`update_prompts` where the step counts one prompt's responses), so that a prompt first met late in a
    run starts from the population's beta rather than from ``init_beta``.
    The module feeds :meth:`update_prompts` the KL of every prompt of the iteration, summed over all ranks,
    so every rank holds the same table."""

    keyed_by_prompt = True
    budget_column: Optional[str] = None
    keyed_by_prompt = True

    @abstractmethod
    def set_budgets(self, budgets: Optional[dict[str, float]]) -> None:
        """Each prompt id's budget (the prompt file's ``budget_column``), at start-up; None: ``target`` for every prompt."""

    @abstractmethod
    def budgets_of(self, prompt_ids: Sequence[str]) -> Tensor:
        """The KL budget of each prompt id (float64, (len(prompt_ids),)), in ``unit``."""

    @abstractmethod
    def betas_of(self, prompt_ids: Sequence[str]) -> Tensor:
        """The beta of each prompt id (float64, (len(prompt_ids),)): its own, or ``beta`` before it has one."""

    @abstractmethod
    def update_prompts(self, prompt_ids: Sequence[str], observed_kls: Tensor, n_samples: Tensor) -> None:
        """Update the betas of ``prompt_ids`` (the prompts of this iteration, on every rank) from each one's
        observed KL in ``unit`` over its ``n_samples`` responses; prompts not named keep their beta."""

    def prompt_ids(self) -> list[str]:
        """The ids of the prompts the controller holds a beta of (after a resume, the checkpoint's: compared with the
        prompt file's, ``checkpoints.load_state``); here the keys of its state's ``betas``."""
        return [str(prompt_id) for prompt_id in self.state_dict().get("betas", {})]


class AdvantageEstimator(Plugin):
    """Turns one rollout's per-token rewards into advantages (and, with a critic, value targets).

    The rollout holds ``group_size`` responses per prompt in consecutive rows (``model.sampling.num_generations``),
    and ``rewards`` is R_t = r_RM * 1[t = T] - beta * kl_t (the KL term only when the penalty is in
    the reward), shape (batch, response_len), zero off ``mask``. Class attributes declare what the
    estimator needs, so the module can check a config at start-up:

    - ``needs_critic``: it reads ``values`` (V(s_t) of the rollout) and returns value targets; a
      critic-free estimator is called with ``values=None`` and returns ``(advantages, None)``.
    - ``min_group_size``: the smallest ``num_generations`` it is defined for (2 for group baselines).
    - ``whiten``: whether the module whitens its advantages over the global batch by default
      (``model.ppo.whiten_advantages: null``); estimators that normalise themselves say False.
    - ``loss_aggregation``: the registered loss aggregation the estimator is defined with, if any
      (Dr. GRPO's ``constant``), used when ``model.loss_aggregation`` is null.
    """

    needs_critic: bool = False
    min_group_size: int = 1
    whiten: bool = False
    loss_aggregation: Optional[str] = None

    @abstractmethod
    def __call__(
        self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_size: int, sum_fn=None
    ) -> tuple[Tensor, Optional[Tensor]]:
        """``(advantages, returns)``, each (batch, response_len) and zero off ``mask``; ``returns``
        (the critic's targets) is None for a critic-free estimator. ``sum_fn`` all-reduces sums
        across ranks, for estimators that normalise over the global batch."""

    def gradient_scale(self, rewards: Tensor, mask: Tensor, group_size: int, sum_fn=None) -> Tensor:
        """Per response (batch,): the factor by which the advantages scale the expected policy
        gradient of each response's return (1: an unbiased estimator, unnormalised). A KL in the
        loss is scaled by it too (``PPOUpdate.run``'s ``kl_coef``), so that beta weighs the KL
        against the reward as configured whatever the estimator normalises by."""
        return torch.ones(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)

    def checked(
        self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_size: int, sum_fn=None
    ) -> tuple[Tensor, Optional[Tensor]]:
        """``self(...)``, refused (ConfigError naming the estimator) unless the shapes are the
        contract's: advantages like ``rewards``, returns like them only when it needs a critic."""
        advantages, returns = self(rewards, mask, values, group_size, sum_fn)
        expected = (tuple(rewards.shape), tuple(rewards.shape) if self.needs_critic else None)
        got = (tuple(advantages.shape), None if returns is None else tuple(returns.shape))
        require(
            got == expected,
            f"the (advantages, returns) shapes of advantage estimator {type(self).__name__}",
            f"{expected}: (batch, response_len), and returns only when it needs a critic",
            got,
        )
        return advantages, returns


class PolicyLoss(Plugin):
    """The per-token policy-gradient loss of one micro-batch, before aggregation over tokens.

    Receives log pi_theta of the sampled tokens (with gradient), log pi_old (the sampler's), the
    advantages and the response mask, each (batch, response_len), and returns ``(loss, clipped)``:
    the loss of every token and a 0/1 tensor marking tokens where a clip or truncation was active
    (logged as ``policy/clipfrac``), both zero off the mask. The module sums the loss with the
    weights of the ``LossAggregation``. ``loss_aggregation`` optionally names the aggregation the
    loss is defined with (GSPO's sequence mean), used when ``model.loss_aggregation`` is null.
    """

    loss_aggregation: Optional[str] = None

    @abstractmethod
    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]: ...


class LossAggregation(Plugin):
    """How per-token losses become one number: weights w (batch, response_len), zero off the mask,
    such that the loss of the whole minibatch (all micro-batches, all ranks) is sum w * loss_t.

    ``sum_fn`` all-reduces sums across ranks (the weights' denominators are global), and
    ``max_new_tokens`` is the configured response length (for constant normalisers)."""

    @abstractmethod
    def weights(self, mask: Tensor, max_new_tokens: int, sum_fn=None) -> Tensor: ...


class ReferenceUpdate(Plugin):
    """When, and how far, the KL's reference moves toward the policy.

    After PPO iteration ``i`` (1-based) the module sets ``ref <- (1 - alpha) ref + alpha policy``
    in the reference's own parameters (the frozen copy under full fine-tuning; a second, frozen
    LoRA adapter under LoRA), with ``alpha = weight(i)``; 0 leaves the reference where it is.
    alpha = 1 makes the reference the current policy, so the next rollout's KL is exactly 0.
    Class attributes declare what the module must build:

    - ``moves``: False only for the frozen reference (no second adapter or initial copy is built,
      and ``objective/kl_to_initial`` is ``objective/kl``).
    - ``reset_optimizer``: also clear the optimizer state (Adam moments) of the policy's
      parameters at each update (ProRL's reference reset, Liu et al. 2025).
    """

    moves: bool = True
    reset_optimizer: bool = False

    def __init__(self, every_n_iterations: int = 1) -> None:
        require_number("reference_update.every_n_iterations", every_n_iterations, integer=True, at_least=1)
        self.every_n_iterations = every_n_iterations

    @abstractmethod
    def weight(self, iteration: int) -> float:
        """alpha in [0, 1] of the update after PPO iteration ``iteration`` (1-based); 0: no update."""


class RewardModel(Plugin):
    """Scores responses: one float per (prompt, response) pair, from their decoded text.

    Subclasses implement :meth:`score`. Calling the backend validates the scores (shape,
    finiteness), applies the optional missing-EOS penalty, running mean/std normalisation
    and clipping, in that order, and returns the scores the policy is trained on.

    Args:
        normalize: whiten scores with a running mean/std over every score seen so far.
        clip: clip the (normalised) scores to ``[-clip, clip]``.
        missing_eos_penalty: subtracted from the score of a response that never emitted EOS.
    """

    thread_safe: bool = True
    """Whether the backend may be called from a thread other than the trainer's (the asynchronous sampler's,
    ``model.off_policy.score_in_sampler``). A backend bound to the thread that set it up (a client of one thread)
    sets it False: with ``model.off_policy.max_staleness`` > 0 the run then needs ``score_in_sampler: false``,
    refused at start-up otherwise."""

    def __init__(
        self,
        normalize: bool = False,
        clip: Optional[float] = None,
        missing_eos_penalty: Optional[float] = None,
    ) -> None:
        self.shaping = ScoreShaping(normalize, clip, missing_eos_penalty)

    @abstractmethod
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor | Sequence[float]:
        """Raw scores, one per response."""

    # Not abstract: optional hooks, kept empty by a backend with nothing to do.
    def setup(self, device: torch.device) -> None:
        """Called once before use with the device the policy runs on (load or move models here)."""

    def check_prompts(self, prompts: Sequence[str], field: str, role: str) -> None:
        """Called at start-up with every prompt of a prompt file (``field``: ``data.train_path``),
        before any model loads: a backend that can score only some prompts refuses the others here
        with a ConfigError naming ``field`` and ``role`` (``model.reward_model``), not at the first batch."""

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ended_with_eos: Tensor,
        sum_fn=None,
        update_stats: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Return ``(raw_scores, train_scores)``: :meth:`checked_scores` then :meth:`shape_scores`."""
        raw = self.checked_scores(prompts, responses)
        return raw, self.shape_scores(raw, ended_with_eos, sum_fn, update_stats)

    def checked_scores(self, prompts: Sequence[str], responses: Sequence[str], role: Optional[str] = None) -> Tensor:
        """Raw scores as float32 (batch,) on CPU, checked (``reward_shaping.check_scores``); a fault
        names the backend, and ``role`` when given (``model.gold_reward_model``: not the trained reward)."""
        backend = type(self).__name__ if role is None else f"{type(self).__name__} ({role})"
        return check_scores(self.score(prompts, responses), backend, len(responses))

    def shape_scores(self, raw: Tensor, ended_with_eos: Tensor, sum_fn=None, update_stats: bool = True) -> Tensor:
        """The scores the policy is trained on (``reward_shaping.ScoreShaping``)."""
        return self.shaping(raw, ended_with_eos, sum_fn, update_stats)

    def state_dict(self) -> dict[str, Any]:
        return self.shaping.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shaping.load_state_dict(state)


@dataclass
class Samples:
    """What a rollout engine returns for a batch of prompts: each row's prompt and response, and
    the sampler's scores of the response tokens. ``logits`` (an engine that samples with the
    trainer's own model, ``hf``) or ``logprobs`` (any other engine) must be set."""

    sequences: Tensor  # (batch, prompt_len + new): the prompts as given (left-padded), then the responses, right-padded
    logits: Optional[Tensor] = None  # (batch, new, vocab): the policy's raw logits (before temperature) at each response position
    logprobs: Optional[Tensor] = None  # (batch, new): log-prob of each sampled token under the distribution it was drawn from
    hidden: Optional[Tensor] = None  # (batch, new, hidden): last hidden states at those positions (``hf``, for a shared critic)


class RolloutEngine(Plugin):
    """Samples the rollout's responses from the policy: ``model.sampling.temperature``, ``top_k``, ``top_p``,
    ``max_new_tokens``, ``min_new_tokens`` and the tokenizer's EOS.

    Every method but ``setup`` is handed the sampler (rlhf_lightning/sampler.py), or a view of it on another copy of
    the weights, as ``module``: its ``networks``, ``sampling``, ``prompts``, ``off_policy``, ``runtime``,
    ``tokenizer``, ``device``, ``exploration``, ``global_step``, ``global_rank``, ``local_rank`` and
    ``generation_seed_base``. The declared distribution (docs/rollout-engines.md): at each position the policy's
    logits over the temperature, restricted to the sampler's kept set (top-k, then top-p) and renormalised. An
    engine returns the log-prob of each sampled token under it (``Samples.logprobs``), or the raw logits it sampled
    from (``Samples.logits``, the trainer's own model). An engine that keeps its own copy of the weights says it
    lags (``stale``) whenever ``module.global_step`` (optimizer steps taken) has changed since it last synced, and
    the sampler calls ``sync`` before it samples. ``setup`` runs at start-up with the LightningModule, before any
    model loads: it refuses (ConfigError, naming ``model.rollout_engine``) what the engine cannot run.
    """

    samples_stale_weights: bool = False
    """Whether the engine samples the weights of the sampler it is given: ``module.networks``' policy, through
    ``module.networks.generator()`` (``hf``) or its own copy synced from it whenever ``module.global_step`` changes
    (``vllm``), so that an asynchronous sampler (``model.off_policy.max_staleness`` > 0,
    rlhf_lightning/async_rollout.py) can hand it a published copy of older weights (a view of the sampler whose
    networks and ``global_step`` are that version's)."""

    draws_exploration: bool = False
    """Whether the engine draws from ``model.sampling.explore``'s mixture (1 - epsilon) pi + epsilon U, reading epsilon
    from ``module.exploration``, and returns the policy's own logits (``Samples.logits``) beside it."""

    def setup(self, module) -> None:
        """Check that the engine can serve ``module`` as configured (strategy, world size); load nothing."""

    def start(self, module) -> None:
        """Called once in the trainer's thread with the asynchronous sampler (``module``) before its
        first draw (which may run in a thread of its own, beside the trainer): start here what touches the process's
        state (its random generators, a collective)."""

    def memory_bytes(
        self, *, rows: int, prompt_tokens: int, new_tokens: int, vocab: int, layers: int, kv_width: int, weight_bytes: int, device
    ) -> dict[str, tuple[int, str]]:
        """What sampling ``rows`` responses of ``new_tokens`` to prompts of ``prompt_tokens`` holds beside the trainer's
        tensors, for the start-up memory estimate (rlhf_lightning/memory.py): {what: (bytes, how to make it smaller: the
        settings to change)}, from the policy's vocabulary, layers, KV width per layer and weights' bytes, on ``device``. The default,
        ``hf``'s: a KV cache in float32 and the logits of every response position twice (generate's per step, stacked)."""
        kv_cache = rows * (prompt_tokens + new_tokens) * layers * 2 * kv_width * 4
        lower = "lower data.batch_size, model.sampling.num_generations or model.sampling.max_new_tokens"
        return {"the KV cache and the logits of generation": (kv_cache + 2 * rows * new_tokens * vocab * 4, lower)}

    def stale(self, module) -> bool:
        """Whether the engine's own copy of the policy's weights lags behind the policy's (an engine
        sampling the trainer's own model has none: never). The sampler then calls ``sync`` before the
        draw, timed as ``weight_sync``."""
        return False

    def sync(self, module) -> None:
        """Bring the engine's own copy of the policy's weights up to date (on every rank at once)."""

    @abstractmethod
    def sample(self, module, enc: dict[str, Tensor], seed: int) -> Samples:
        """Responses to the prompts ``enc`` (``input_ids``, ``attention_mask``, left-padded), drawn
        from a generator seeded by ``seed`` (a resumed run draws the same responses)."""

    def checked_sample(self, module, enc: dict[str, Tensor], seed: int) -> Samples:
        """``sample``, refused (ConfigError naming the engine) unless it keeps the prompts and scores
        every response position: logits (batch, new, vocab) or log-probs (batch, new)."""
        out = self.sample(module, enc, seed)
        batch, prompt_len = enc["input_ids"].shape
        new = out.sequences.shape[1] - prompt_len
        shape = (batch, new, out.logits.shape[-1]) if out.logits is not None else (batch, new)
        scores = out.logits if out.logits is not None else out.logprobs
        require(
            scores is not None
            and tuple(scores.shape) == shape
            and out.sequences.shape[0] == batch
            and torch.equal(out.sequences[:, :prompt_len].cpu(), enc["input_ids"].cpu()),
            f"the samples of rollout engine {type(self).__name__}",
            "the prompts as given, then the responses, with logits (batch, new, vocab) or log-probs (batch, new)",
            None if scores is None else f"sequences {tuple(out.sequences.shape)}, scores {tuple(scores.shape)}",
        )
        return out


@dataclass
class Step:
    """What an environment answers to one policy turn (``Environment.step``)."""

    observation: Optional[str] = None  # text of the environment's turn: in its chat role where the tokenizer has a template
    observation_ids: Optional[list[int]] = None  # or token ids, appended exactly as they are (a token-level environment)
    reward: Optional[float] = None  # this turn's reward, credited to the policy's turn it answers (None: 0)
    done: bool = False  # the episode ends here (nothing is appended)
    info: dict[str, Any] = field(default_factory=dict)  # counted in env/*: ``tool_call`` (bool), ``tool_ok`` (bool)


class Environment(Plugin):
    """The other side of an episode (docs/environments.md): the policy writes a turn, the environment answers it, the
    policy writes again, until the environment says ``done`` or a limit ends the episode.

    ``reset(prompt, seed)`` starts an episode for one row and returns its state (anything: a dict, the library's own
    environment object); ``step(state, turn_text, turn_ids)`` takes the policy's turn (its text, special tokens left
    out, and its ids as drawn) and returns a :class:`Step`. The environment's tokens are state, not actions: the
    KL, the policy loss, the entropy and the advantages' credit cover the policy's tokens only, while the
    environment's stay context for everything after them (``policy_tokens_only: false`` counts them too, the known
    mistake, kept to measure it: a start-up warning says so).

    The limits every environment takes (its ``init_args``, beside its own): ``max_turns`` policy turns per episode;
    ``max_total_tokens`` the episode's tokens after the prompt, policy's and environment's (None: the policy's
    context, checked at start-up); ``max_observation_tokens`` per environment turn (a longer one ends the episode,
    counted in ``env/ended_by_observation_too_long``); ``timeout_s`` per call of ``reset`` or ``step`` (a hung
    environment stops the run with a line naming it and this field). An environment that raises stops the run with
    a line naming it and ``model.environment``. ``role``: the chat role of its turns (``tool``, ``user``, ...).
    ``thread_safe``: the rows' ``step`` calls may run concurrently in threads.
    """

    role: str = "tool"
    thread_safe: bool = True

    def __init__(
        self,
        max_turns: int = 3,
        max_total_tokens: Optional[int] = None,
        max_observation_tokens: int = 256,
        timeout_s: float = 60.0,
        policy_tokens_only: bool = True,
    ) -> None:
        field = "environment."
        require_number(field + "max_turns", max_turns, at_least=1, integer=True)
        require_number(field + "max_total_tokens", max_total_tokens, at_least=1, integer=True, optional=True)
        require_number(field + "max_observation_tokens", max_observation_tokens, at_least=1, integer=True)
        require_number(field + "timeout_s", timeout_s, above=0)
        require(isinstance(policy_tokens_only, bool), field + "policy_tokens_only", "true or false", policy_tokens_only)
        self.max_turns, self.max_total_tokens, self.max_observation_tokens = max_turns, max_total_tokens, max_observation_tokens
        self.timeout_s, self.policy_tokens_only = timeout_s, policy_tokens_only

    @abstractmethod
    def reset(self, prompt: str, seed: int) -> Any:
        """Start an episode for ``prompt`` (seeded by ``seed``: a redrawn episode is the same); its state."""

    @abstractmethod
    def step(self, state: Any, turn_text: str, turn_ids: Sequence[int]) -> Step:
        """Answer the policy's turn in the episode ``state`` (updated in place)."""

    def close(self) -> None:
        """Release what the environment holds (processes, connections) at the end of the run."""


register_kind("kl_estimator", KLEstimator)
register_kind("beta_controller", BetaController)
register_kind("divergence", Divergence)
register_kind("reward_model", RewardModel)
register_kind("advantage_estimator", AdvantageEstimator)
register_kind("policy_loss", PolicyLoss)
register_kind("loss_aggregation", LossAggregation)
register_kind("reference_update", ReferenceUpdate)
register_kind("rollout_engine", RolloutEngine)
register_kind("environment", Environment)
