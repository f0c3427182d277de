"""The module's arguments: the groups of settings (each field documented and checked where it is
declared), the plugins built from their names, and the rules across groups and plugins, all decided from
the arguments alone, before any model loads. Every refusal is a ConfigError naming the field as the user
writes it (``model.sampling.temperature``) and what it must be. What needs more than the arguments (the
tokenizer, the prompt files, a model's context) is checked at start-up (checks.py); which KL recipe
reaches which optimum is recipes.py's.

``PPORLHF`` takes the plugins and the network keys flat and everything else in these groups; in
YAML a group reads nested (``model.sampling.temperature``, ``model.kl.placement``). The flat names
of 0.1 (``model.lr``) are refused by the command with the new key (``cli.check_config_files``), and
accepted by the Python API with a FutureWarning (:func:`regroup`); the top-level arguments that 0.3 folded
into ``model.loading`` (``model.seed``) are read by both with a FutureWarning (``FOLDED``); both paths
end in ``REMOVED_IN``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning.pytorch.utilities import rank_zero_warn

from rlhf_lightning import episodes, recipes, trust_regions
from rlhf_lightning.checks import ConfigError, require, require_number, unused_settings
from rlhf_lightning.data import encode_prompts, template_columns
from rlhf_lightning.interfaces import Divergence, LossAggregation
from rlhf_lightning.registry import registry

# Arguments that name plugins: built here, kept out of the saved hyperparameters (the config
# file has them as written; checkpoints store each plugin's class path and state instead).
PLUGIN_ARGUMENTS = {
    "reward_model": "reward_model",
    "kl_estimator": "kl_estimator",
    "divergence": "divergence",
    "beta_controller": "beta_controller",
    "advantage_estimator": "advantage_estimator",
    "policy_loss": "policy_loss",
    "loss_aggregation": "loss_aggregation",
    "entropy_controller": "beta_controller",
    "gold_reward_model": "reward_model",
    "reference_update": "reference_update",
    "rollout_engine": "rollout_engine",
    "environment": "environment",
}
# Below this temperature a group's responses are mostly one and the same (the sampler all but argmax).
GREEDY_TEMPERATURE = 0.1


def _choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    requirement = f"'{choices[0]}' or '{choices[1]}'" if len(choices) == 2 else "one of " + ", ".join(choices)
    require(value in choices, field, requirement, value)


@dataclass(frozen=True)
class SamplingArgs:
    """How responses are sampled (``model.sampling``): every log-prob is of the same tempered
    distribution on the sampler's kept set (sampling.py, docs/rollout-engines.md)."""

    num_generations: int = 1
    """Responses sampled per prompt; a rollout holds prompts x num_generations responses, each
    prompt's group in consecutive rows on one rank."""
    max_new_tokens: int = 32
    """The longest response in tokens; one that reaches it without EOS is truncated."""
    min_new_tokens: int = 0
    """EOS is suppressed before this many tokens (the sampled distribution is then the policy's
    with EOS removed, and every log-prob is of that distribution)."""
    do_sample: bool = True
    """Sample (PPO) or decode greedily (evaluation; tests that need rollouts that depend on the weights alone)."""
    temperature: float = 1.0
    """The softmax temperature of the sampled distribution (> 0)."""
    top_k: int = 0
    """Keep the k most likely tokens at each step; 0: no top-k truncation."""
    top_p: float = 1.0
    """Keep the smallest set of tokens with this much probability; 1: no nucleus truncation."""
    old_logprobs: Literal["sampler", "forward"] = "sampler"
    """Where the PPO ratio's log pi_old (and a shared critic's V_old) come from: ``sampler`` (the
    engine's: ``hf``'s logits, no extra forward) or ``forward`` (one batched forward)."""
    rollout_correction: Literal["none", "tis", "mis", "seq_tis", "seq_mis"] = "none"
    """Weigh each token's policy loss, KL loss and logged KL by pi_old / pi_sampler of the token
    (``tis``, ``mis``) or of the response (``seq_tis``, ``seq_mis``)."""
    rollout_correction_cap: float = 2.0
    """The weights are truncated at the cap (tis) or 0 outside [1 / cap, cap] (mis); >= 1."""
    explore: float = 0.0
    """epsilon in [0, 1): each token is drawn from the behaviour policy mu = (1 - epsilon) pi + epsilon U, U uniform over
    the tokens pi can draw (probability > 0: the kept set), so that states the policy rarely visits are met; each
    token's loss terms are weighed by pi_old / mu of that token (at most 1 / (1 - epsilon)), and log pi_old stays the
    policy's (docs/divergences.md, "Exploring"). 0: sample pi itself. epsilon falls linearly to 0 over
    ``explore_iterations``; from there the loop is on-policy, bit for bit the same as without exploration."""
    explore_iterations: int = 0
    """Iterations over which ``explore`` falls linearly to 0 (iteration i explores with epsilon (1 - i / n)); >= 1
    with ``explore`` > 0."""

    def __post_init__(self) -> None:
        f = "model.sampling."
        require_number(f + "num_generations", self.num_generations, at_least=1, integer=True)
        require_number(f + "max_new_tokens", self.max_new_tokens, at_least=1, integer=True)
        require(
            isinstance(self.min_new_tokens, int) and 0 <= self.min_new_tokens <= self.max_new_tokens,
            f + "min_new_tokens",
            f"an integer in [0, model.sampling.max_new_tokens = {self.max_new_tokens}]",
            self.min_new_tokens,
        )
        require_number(f + "temperature", self.temperature, above=0)
        require_number(f + "top_p", self.top_p, above=0, at_most=1)
        require(isinstance(self.top_k, int) and self.top_k >= 0, f + "top_k", "an integer >= 0 (0: no top-k truncation)", self.top_k)
        # One kept token: the declared distribution is a point mass, every log-prob 0, no gradient.
        require(
            self.top_k != 1 or not self.do_sample,
            f + "top_k",
            "0 or >= 2 (top_k 1 keeps one token at each position: sampling is greedy, every log-prob of the sampled distribution "
            "is 0, no gradient reaches the policy and nothing is learnt; for greedy rollouts set model.sampling.do_sample: false)",
            self.top_k,
        )
        _choice(f + "old_logprobs", self.old_logprobs, ("sampler", "forward"))
        _choice(f + "rollout_correction", self.rollout_correction, ("none", "tis", "mis", "seq_tis", "seq_mis"))
        require_number(f + "rollout_correction_cap", self.rollout_correction_cap, at_least=1)
        require_number(f + "explore", self.explore, at_least=0, below=1)
        require_number(f + "explore_iterations", self.explore_iterations, at_least=1 if self.explore else 0, integer=True)
        require(
            not self.explore or self.do_sample,
            f + "explore",
            "0 with model.sampling.do_sample false (greedy decoding draws nothing to explore with)",
            self.explore,
        )
        require(
            self.rollout_correction == "none" or self.old_logprobs == "forward",
            f + "rollout_correction",
            "'none' unless model.sampling.old_logprobs is 'forward' (the correction weighs each token by pi_old / pi_sampler, "
            "pi_old from the trainer)",
            self.rollout_correction,
        )

    def exploration(self, iteration: int) -> float:
        """epsilon of ``iteration``: ``explore`` falling linearly to 0 over ``explore_iterations``."""
        return self.explore * max(0.0, 1.0 - iteration / self.explore_iterations) if self.explore else 0.0


@dataclass(frozen=True)
class PromptArgs:
    """How prompts become tokens (``model.prompts``)."""

    max_length: int = 256
    """The longest rendered prompt in tokens; a longer prompt is an error naming it."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template when it has one."""
    special_tokens: Literal["refuse", "allow"] = "refuse"
    """``refuse`` a prompt containing a special-token string (``<|im_end|>``: it could forge chat
    turns), or ``allow`` pre-rendered chat text."""
    teacher_template: Optional[str] = None
    """The reference's prompt (a teacher that sees more: docs/reference.md): a Python format string of ``{prompt}``
    and the training prompt file's columns (``"{prompt}\nThe answer is {answer}."``), rendered and tokenised as the
    student's prompt; the student's response ids are scored after it as drawn. Null: the student's prompt."""

    def __post_init__(self) -> None:
        require_number("model.prompts.max_length", self.max_length, at_least=1, integer=True)
        _choice("model.prompts.special_tokens", self.special_tokens, ("refuse", "allow"))
        if self.teacher_template is not None:
            template_columns(self.teacher_template)

    def encode(self, tokenizer, prompts: list[str], field: str = "the prompts") -> dict[str, Any]:
        """``data.encode_prompts`` with these settings: rendered, left-padded, each checked (a ConfigError naming ``field``)."""
        return encode_prompts(tokenizer, prompts, self.chat_template, self.max_length, self.special_tokens, field)


@dataclass(frozen=True)
class KLArgs:
    """Where beta * KL goes and what its gradient is the gradient of (``model.kl``;
    docs/kl-estimators.md). The estimator and beta's controller are plugins of their own."""

    placement: Literal["reward", "loss", "both"] = "reward"
    """Into the per-token ``reward`` (PPO-RLHF), a separate ``loss`` term (GRPO style), or ``both``."""
    loss_weighting: Literal["none", "importance"] = "importance"
    """The KL loss term of tokens sampled from pi_old while pi_theta moves over the PPO epochs:
    ``importance`` weighs each token's estimate by pi_theta(y_t) / pi_old(y_t); ``none``
    differentiates the estimate as it is."""
    loss_scope: Literal["sequence", "per_token"] = "sequence"
    """What the KL loss term's gradient is the gradient of: ``sequence``, the whole response's KL
    (the per-token term plus the KL still to come, ``ppo_math.kl_to_go_loss``), or ``per_token``,
    each visited state's own KL, whose fixed point is not the KL-regularised optimum."""
    ignore_tokens: Optional[list[str]] = None
    """Tokens left out of the KL penalty wherever they are sampled (``["<|im_end|>"]``: end-of-turn
    tokens often dominate the KL); ``eos`` means the EOS token."""

    def __post_init__(self) -> None:
        _choice("model.kl.placement", self.placement, ("reward", "loss", "both"))
        _choice("model.kl.loss_weighting", self.loss_weighting, ("none", "importance"))
        _choice("model.kl.loss_scope", self.loss_scope, ("sequence", "per_token"))

    @property
    def in_reward(self) -> bool:
        return self.placement in ("reward", "both")

    @property
    def in_loss(self) -> bool:
        return self.placement in ("loss", "both")


@dataclass(frozen=True)
class PPOArgs:
    """The update (``model.ppo``): passes over each rollout and the loss's terms besides the policy loss."""

    epochs: int = 4
    """Passes over each rollout."""
    num_minibatches: int = 1
    """Minibatches per pass, one optimizer step each."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per minibatch."""
    cliprange_value: float = 0.2
    """The value loss's clip range (> 0)."""
    vf_coef: float = 0.1
    """The value loss's weight (>= 0)."""
    whiten_advantages: Optional[bool] = None
    """Whiten the advantages over the global batch; null: the estimator's default (gae: yes;
    critic-free estimators: no), and no whenever the KL is in the loss."""
    entropy_coef: float = 0.0
    """A fixed entropy bonus: - entropy_coef * H_t per token in the loss (>= 0; 0 with an entropy controller)."""

    def __post_init__(self) -> None:
        f = "model.ppo."
        for name in ("epochs", "num_minibatches", "gradient_accumulation_steps"):
            require_number(f + name, getattr(self, name), at_least=1, integer=True)
        require_number(f + "cliprange_value", self.cliprange_value, above=0)
        require_number(f + "vf_coef", self.vf_coef, at_least=0)
        require_number(f + "entropy_coef", self.entropy_coef, at_least=0)


@dataclass(frozen=True)
class OptimArgs:
    """AdamW and gradient clipping (``model.optim``)."""

    lr: float = 1e-5
    """The policy's learning rate (> 0)."""
    critic_lr: Optional[float] = None
    """The critic's learning rate; null: ``lr``. Unset without a critic."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (>= 0)."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the gradient norm to this (> 0); null: no clipping."""
    optimizers: Literal["separate", "shared"] = "separate"
    """One AdamW with policy and critic groups, clipped each on its own (``separate``) or jointly (``shared``)."""

    def __post_init__(self) -> None:
        f = "model.optim."
        require_number(f + "lr", self.lr, above=0)
        require_number(f + "critic_lr", self.critic_lr, above=0, optional=True)
        require_number(f + "weight_decay", self.weight_decay, at_least=0)
        require_number(f + "max_grad_norm", self.max_grad_norm, above=0, optional=True)
        _choice(f + "optimizers", self.optimizers, ("separate", "shared"))


@dataclass(frozen=True)
class LoraArgs:
    """LoRA (``model.lora``): rank 0 is full fine-tuning."""

    rank: int = 0
    """0 for full fine-tuning; > 0 trains a LoRA adapter and the reference is the same weights with
    the adapter disabled (no second copy in memory)."""
    alpha: float = 16.0
    """The adapter's scale numerator (> 0): its update is scaled by alpha / rank."""
    target_modules: Optional[list[str]] = None
    """The modules that get an adapter; null: every linear layer."""
    merge_for_generation: bool = True
    """Merge the adapter into the (fp32) base weights while sampling and unmerge after (no LoRA
    branch per decode step; each merge rounds by at most one ulp)."""

    def __post_init__(self) -> None:
        require_number("model.lora.rank", self.rank, at_least=0, integer=True)
        require_number("model.lora.alpha", self.alpha, above=0)
        require(
            self.rank > 0 or self.target_modules is None,
            "model.lora.target_modules",
            "null with model.lora.rank 0 (full fine-tuning: no adapter is built; set model.lora.rank > 0 for LoRA)",
            self.target_modules,
        )


@dataclass(frozen=True)
class RuntimeArgs:
    """How the run executes and reports (``model.runtime``)."""

    shared_prompts: bool = True
    """Rows with the same prompt share one forward pass over it in every trainer forward; where
    every prompt is distinct, the first tokens they all share (a system prompt) run once (prefix.py)."""
    matmul_precision: Optional[Literal["highest", "high", "medium"]] = None
    """``torch.set_float32_matmul_precision`` at start-up (``high``: TF32 on Ampere and later
    GPUs); null leaves torch's default (``highest``)."""
    max_consecutive_faults: int = 3
    """Iterations in a row that may be skipped for a non-finite reward, KL or loss before the run
    stops with the cause."""
    log_samples_every_n_steps: int = 10
    """Iterations between sample tables in TensorBoard; 0: none."""
    num_logged_samples: int = 4
    """Responses in each sample table."""

    def __post_init__(self) -> None:
        f = "model.runtime."
        require(
            self.matmul_precision in (None, "highest", "high", "medium"),
            f + "matmul_precision",
            "highest, high, medium or null",
            self.matmul_precision,
        )
        require_number(f + "max_consecutive_faults", self.max_consecutive_faults, at_least=1, integer=True)
        require_number(f + "log_samples_every_n_steps", self.log_samples_every_n_steps, at_least=0, integer=True)
        require_number(f + "num_logged_samples", self.num_logged_samples, at_least=0, integer=True)


@dataclass(frozen=True)
class LoadingArgs:
    """How the networks that ``model.policy``, ``model.tokenizer`` and ``model.reference`` name are built
    (``model.loading``; models.py): what a checkpoint may run, and the ``tiny`` policy's shape and seed."""

    trust_remote_code: bool = False
    """Run a checkpoint's own modelling and tokenizer code (transformers' ``trust_remote_code``) for the policy,
    the reference and their tokenizers."""
    tiny_config: Optional[dict] = None
    """Overrides of the ``tiny`` policy's LlamaConfig (``{hidden_size: 32}``); null: the built-in one (models.TINY_CONFIG)."""
    seed: int = 0
    """The seed the ``tiny`` policy is initialised from (a pretrained policy's weights are its checkpoint's)."""

    def __post_init__(self) -> None:
        require_number("model.loading.seed", self.seed, integer=True)
        require(
            self.tiny_config is None or isinstance(self.tiny_config, dict),
            "model.loading.tiny_config",
            "a mapping of LlamaConfig fields, or null",
            self.tiny_config,
        )


# model.off_policy.correction -> the mode of ``sampling.correction_weights`` from mu (the stale sampler) to pi_prox
OFF_POLICY_WEIGHTS = {"sequence": "seq_tis", "token": "tis", "none": "none", **{name: name for name in trust_regions.TRUST_REGIONS}}


@dataclass(frozen=True)
class OffPolicyArgs:
    """Asynchronous rollouts (``model.off_policy``; docs/async.md): the next batches are sampled while
    the current one trains, from weights at most ``max_staleness`` updates old. A version is the number
    of PPO updates done; the batch of iteration i is sampled from version max(0, i - max_staleness),
    each response tagged with it (``Trajectory.policy_version``), its log-probs kept as the behaviour
    policy's (``Trajectory.sampler_logprobs``), and the PPO ratio anchored at the current weights
    (``model.sampling.old_logprobs: forward``)."""

    max_staleness: int = 0
    """k: how many updates old the weights that sample a batch may be (>= 0); 0 is the synchronous loop
    (sample, then score, then update, as without this group). The sampler runs ahead at exactly k: it
    samples batch i + k while iteration i trains (pacing, never discarding)."""
    sampler_timeout_s: Union[float, str, None] = 600.0
    """The longest the trainer waits for the sampler's next batch, in seconds (> 0), or ``never`` (YAML
    ``never`` or ``null``: wait for ever; Ctrl+C still stops the wait at once); past it the run stops with
    an error naming this field (a sampler that hangs must not hang the run)."""
    correction: Literal["sequence", "token", "none", "icepop", "ipo", "m2po"] = "sequence"
    """How a stale batch's terms are weighed from the behaviour policy mu to the proximal one (every term of
    the loss: the policy loss, the KL in the loss, the logged KL; docs/kl-estimators.md, "Stale samples"):
    ``sequence``, the whole response's pi_prox(y|x) / mu(y|x), exact for every KL placement and estimator
    (truncated at ``correction_cap``); ``token``, each token's pi_prox(y_t|s_t) / mu(y_t|s_t), approximate (the
    states and the continuation stay mu's); ``none``, no weight (biased: to see the bias); a sampler-side trust region
    (``icepop``, ``ipo``, ``m2po``: the token's weight inside it, 0 outside; approximate, ``trust_regions``). Used with
    ``max_staleness`` > 0 (at 0 mu is pi_prox)."""
    correction_cap: float = 5.0
    """The weights are truncated at this (>= 1): min(w, cap). Exact where no weight exceeds it
    (``off_policy/clipped_fraction`` reads how often one does); a higher cap, less bias and more variance."""
    trust_band: Union[float, list[float], None] = None
    """A trust region's setting (``correction`` icepop, ipo or m2po); null, its default: icepop's ratio band [low, high]
    ([0.5, 5]), ipo's delta in probability (0.3), m2po's tau on the kept tokens' mean (log r)^2 (0.04)."""
    min_weight_mass: float = 0.05
    """The floor on the batch's mean correction weight per token (``off_policy/weight_mass``, any correction's, the
    sampler's ``model.sampling.rollout_correction`` included; 0: no check): below it the loss is (almost) zero, and
    the run warns once naming the correction's settings, or stops with ``stop_on_zero_weights`` (``weight_guard``)."""
    stop_on_zero_weights: bool = False
    """Stop the run (an error naming the settings) instead of warning where the weights fall below ``min_weight_mass``."""
    score_in_sampler: bool = True
    """The sampler also scores each batch it draws, in its thread: the reference's log-probs and the reward
    (``timing/sampler_score_s``), so the trainer runs only what needs the current weights (log pi_prox, the
    critic, the update). The same numbers as scoring in the trainer: the reward and a frozen reference do not
    change while a batch waits. A reference that moves (``model.reference_update``) and an engine that returns
    no logits while the sampling truncates (its kept set is then the trainer's) keep the reference's pass in
    the trainer; false: everything after the draw in the trainer. The reward model is then called from the
    sampler's thread (every built-in one may be; one with ``RewardModel.thread_safe`` False is refused at
    start-up, and one that fails there is named by this field in the run's error)."""
    inflight_every: int = 0
    """In-flight weight updates (docs/async.md): every this many response tokens the sampler may move the responses it
    draws to the next version (``inflight.token_versions``: token t of batch i from version min(i - 1, max(0, i - k) +
    t // inflight_every)), each token tagged with its version (``Trajectory.token_versions``); 0: off, one version a
    response. Needs ``max_staleness`` >= 2 (at 1 every batch already samples version i - 1, the newest it may take)."""

    def __post_init__(self) -> None:
        f = "model.off_policy."
        require_number(f + "max_staleness", self.max_staleness, at_least=0, integer=True)
        require_number(f + "inflight_every", self.inflight_every, at_least=0, integer=True)
        why = "batch i takes versions up to i - 1, at max_staleness 1 its only one; inflight_every 0 turns them off"
        inflight = f"{f}inflight_every {self.inflight_every} (in-flight weight updates: {why})"
        require(not self.inflight_every or self.max_staleness >= 2, f + "max_staleness", f">= 2 with {inflight}", self.max_staleness)
        timeout = self.sampler_timeout_s
        if timeout is not None and timeout != "never":
            number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout)
            require(number and timeout > 0, f + "sampler_timeout_s", "a number of seconds > 0 or never (wait for ever)", timeout)
        _choice(f + "correction", self.correction, tuple(OFF_POLICY_WEIGHTS))
        require_number(f + "correction_cap", self.correction_cap, at_least=1)
        require_number(f + "min_weight_mass", self.min_weight_mass, at_least=0, below=1)
        if self.correction in trust_regions.TRUST_REGIONS:
            problem = trust_regions.check_setting(self.correction, self.trust_band)
            require(problem is None, f + "trust_band", problem, self.trust_band)

    @property
    def sampler_timeout(self) -> Optional[float]:
        """``sampler_timeout_s`` in seconds; None for ``never``."""
        return None if self.sampler_timeout_s in (None, "never") else float(self.sampler_timeout_s)

    def weights(self, sampling: SamplingArgs, explore: float = 0.0) -> tuple[str, float]:
        """The mode and cap of ``sampling.correction_weights`` from the sampler's log-probs to the trainer's: this
        group's correction of stale samples with ``max_staleness`` > 0 (mu's log-probs are the sampler's own, its
        numerics included), exploration's per-token pi_old / mu where the batch was drawn exploring with ``explore``
        epsilon > 0 (bounded by 1 / (1 - epsilon): no cap), else ``model.sampling.rollout_correction``'s of the sampler's numerics alone."""
        if explore:
            return "tis", math.inf
        if self.max_staleness and self.correction in trust_regions.TRUST_REGIONS:
            return self.correction, trust_regions.setting_of(self.correction, self.trust_band)
        if self.max_staleness:
            return OFF_POLICY_WEIGHTS[self.correction], self.correction_cap
        return sampling.rollout_correction, sampling.rollout_correction_cap


GROUPS: dict[str, type] = {
    "sampling": SamplingArgs,
    "prompts": PromptArgs,
    "kl": KLArgs,
    "ppo": PPOArgs,
    "optim": OptimArgs,
    "lora": LoraArgs,
    "runtime": RuntimeArgs,
    "off_policy": OffPolicyArgs,
    "loading": LoadingArgs,
}
# The flat names of earlier versions whose field is spelt differently in its group.
_RENAMED = {
    "max_prompt_length": "prompts.max_length",
    "use_chat_template": "prompts.chat_template",
    "special_tokens_in_prompts": "prompts.special_tokens",
    "kl_penalty": "kl.placement",
    "kl_loss_weighting": "kl.loss_weighting",
    "kl_loss_scope": "kl.loss_scope",
    "kl_ignore_tokens": "kl.ignore_tokens",
    "ppo_epochs": "ppo.epochs",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_target_modules": "lora.target_modules",
    "merge_lora_for_generation": "lora.merge_for_generation",
}
# Every flat name of earlier versions (``model.lr``) -> its key now under ``model.`` (``optim.lr``).
FLAT_KEYS: dict[str, str] = {
    **{
        f.name: f"{group}.{f.name}"
        for group, cls in GROUPS.items()
        for f in dataclasses.fields(cls)
        if f"{group}.{f.name}" not in _RENAMED.values()
    },
    **_RENAMED,
}
# Flat settings that left the module: the CPU kernel and malloc are the command's ``cpu`` section.
MOVED_OUT = {"cpu_linear": "cpu.linear", "cpu_malloc": "cpu.malloc"}
# Top-level arguments of 0.2 folded into a group in 0.3: the command still reads them under their old names, with a
# FutureWarning (cli.fold_old_keys), as the Python API does every flat name (regroup), until REMOVED_IN.
FOLDED = {name: f"loading.{name}" for name in ("trust_remote_code", "tiny_config", "seed")}
REMOVED_IN = "0.4.0"


def new_key(flat: str) -> str:
    """Where a flat ``model.<flat>`` setting of an earlier version lives now, as the user writes it."""
    return MOVED_OUT[flat] if flat in MOVED_OUT else f"model.{FLAT_KEYS[flat]}"


def old_keys_warning(flat: Iterable[str]) -> str:
    """The FutureWarning of settings under the names of earlier versions: each one's key now, and the release that
    stops reading the old names."""
    moved = ", ".join(f"model.{name} is now {new_key(name)}" for name in flat)
    return f"settings under the names of earlier versions are deprecated and removed in {REMOVED_IN}: {moved}"


def regroup(flat: dict[str, Any], warn: bool = True) -> dict[str, Any]:
    """Flat settings of earlier versions (``lr=1e-3``) as this version's group arguments
    (``optim=OptimArgs(lr=1e-3)``), with a FutureWarning naming each new key and the release that removes
    the old names (``REMOVED_IN``); group arguments already given as dataclasses or dicts are merged with them.
    The Python API's path until then."""
    moved = [name for name in flat if name in MOVED_OUT]
    if moved:
        raise ConfigError(
            "; ".join(
                f"model.{name} moved out of the module: set {MOVED_OUT[name]} (the command's cpu section, cpu.CPUSettings)"
                for name in moved
            )
        )
    unknown = [name for name in flat if name not in FLAT_KEYS]
    if unknown:
        raise TypeError(f"PPORLHF got unexpected keyword arguments {unknown}")
    if warn:
        warnings.warn(old_keys_warning(flat), FutureWarning, stacklevel=4)
    fields: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        group, field = FLAT_KEYS[name].split(".")
        fields.setdefault(group, {})[field] = value
    return fields


def build_groups(given: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """Each group as its dataclass: ``given`` holds what the caller passed per group (a dataclass,
    a dict of its fields, or None), ``flat`` deprecated flat settings (:func:`regroup`)."""
    settings = merge_settings(given, regroup(flat) if flat else {})
    groups = {}
    for name, cls in GROUPS.items():
        fields = settings.get(name, {})
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        require(not unknown, f"model.{name}", "settings among " + ", ".join(f.name for f in dataclasses.fields(cls)), sorted(unknown))
        groups[name] = cls(**fields)
    return groups


def merge_settings(*layers: dict[str, Any]) -> dict[str, Any]:
    """``PPORLHF`` keyword arguments from layers of settings, a later layer winning field by field
    within a group; a flat name of earlier versions (``lr``) counts as its group's field, without a
    warning (for code that layers settings: the lab's harness, the tests' ``make_module``)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        flat = {name: value for name, value in layer.items() if name in FLAT_KEYS}
        rest = [(name, value) for name, value in layer.items() if name not in FLAT_KEYS]
        for name, value in [*rest, *regroup(flat, warn=False).items()]:
            if name in GROUPS:
                fields = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value or {})
                merged[name] = {**merged.get(name, {}), **fields}
            else:
                merged[name] = value
    return merged


def build_plugins(args: dict[str, Any], ppo: PPOArgs) -> dict[str, Any]:
    """Every plugin argument as an instance (unknown names fail here, naming the field and the
    registered choices): ``model.ppo.entropy_coef`` becomes a fixed entropy controller, and a null
    ``loss_aggregation`` the one the policy loss or advantage estimator is defined with."""

    def build(name: str):
        return registry(PLUGIN_ARGUMENTS[name]).build(args[name], f"model.{name}")

    kinds = ("reward_model", "kl_estimator", "divergence", "beta_controller", "advantage_estimator", "policy_loss")
    plugins = {name: build(name) for name in kinds}
    plugins["loss_aggregation"] = _loss_aggregation(args["loss_aggregation"], plugins)
    coef = ppo.entropy_coef
    require(not (coef and args["entropy_controller"] is not None), "model.ppo.entropy_coef", "0 when model.entropy_controller is set", coef)
    if args["entropy_controller"] is not None:
        plugins["entropy_controller"] = build("entropy_controller")
        require(
            not plugins["entropy_controller"].keyed_by_prompt,
            "model.entropy_controller",
            "a controller with one coefficient (the entropy bonus is one term of the loss, not one per prompt)",
            type(plugins["entropy_controller"]).__name__,
        )
    else:
        plugins["entropy_controller"] = registry("beta_controller").get("fixed")(init_beta=coef, unit="token_mean") if coef else None
    plugins["gold_reward_model"] = None if args["gold_reward_model"] is None else build("gold_reward_model")
    plugins["reference_update"] = build("reference_update")
    plugins["rollout_engine"] = build("rollout_engine")
    plugins["environment"] = None if args["environment"] is None else build("environment")
    return plugins


def _loss_aggregation(spec: Optional[LossAggregation | str], plugins: dict[str, Any]) -> LossAggregation:
    """``model.loss_aggregation``, or (null) the one the policy loss or the advantage estimator
    is defined with, else token_mean; two different such preferences must be settled by the user."""
    policy_loss, estimator = plugins["policy_loss"], plugins["advantage_estimator"]
    if spec is None:
        preferred = {p for p in (policy_loss.loss_aggregation, estimator.loss_aggregation) if p}
        require(
            len(preferred) <= 1,
            "model.loss_aggregation",
            f"set when model.policy_loss {type(policy_loss).__name__} and model.advantage_estimator "
            f"{type(estimator).__name__} are defined with different aggregations",
            sorted(preferred),
        )
        spec = preferred.pop() if preferred else "token_mean"
    return registry("loss_aggregation").build(spec, "model.loss_aggregation")


def check_across_groups(critic: Optional[str], groups: dict[str, Any], plugins: dict[str, Any]) -> dict[str, Any]:
    """The rules that join settings of several groups and plugins; warn of the KL recipes and stale-sample corrections
    that do not reach the KL-regularised optimum (recipes.py).
    Returns the settings resolved from the plugins (``critic``, ``ppo.whiten_advantages``), stored
    resolved so that checkpoints and the resume check see what was built."""
    sampling, kl, ppo, optim, off_policy = (groups[name] for name in ("sampling", "kl", "ppo", "optim", "off_policy"))
    advantage, kl_estimator = plugins["advantage_estimator"], plugins["kl_estimator"]
    episodes.check_settings(plugins["environment"], sampling)
    # Whitening divides the advantages (the reward's gradient, and with 'both' the reward's part
    # of the KL's) by their std; a KL loss term is not divided, so beta would no longer weigh the
    # KL against the reward as configured (docs/kl-estimators.md).
    require(
        kl.placement == "reward" or not ppo.whiten_advantages,
        "model.ppo.whiten_advantages",
        "false when the KL is in the loss (model.kl.placement: loss or both): whitening rescales the advantages but not the KL loss term",
        ppo.whiten_advantages,
    )
    require(
        kl.placement != "loss" or kl.loss_scope == "per_token" or kl_estimator.unbiased_value,
        "model.kl.loss_scope",
        f"'per_token' with model.kl_estimator {type(kl_estimator).__name__}, whose value is not an unbiased per-token KL "
        "(the KL still to come in the response cannot be estimated from it); or use k1, k3 or full",
        kl.loss_scope,
    )
    estimator = type(advantage).__name__
    critic = critic or ("separate" if advantage.needs_critic else "none")
    require(critic in ("separate", "shared", "none"), "model.critic", "'separate', 'shared', 'none' or null", critic)
    require(
        (critic != "none") == advantage.needs_critic,
        "model.critic",
        f"{'separate or shared' if advantage.needs_critic else 'none'} with model.advantage_estimator {estimator}",
        critic,
    )
    require(
        critic != "none" or (optim.critic_lr is None and optim.optimizers == "separate"),
        "model.optim.critic_lr and model.optim.optimizers",
        "unset without a critic (model.critic: none)",
        (optim.critic_lr, optim.optimizers),
    )
    require(
        sampling.num_generations >= advantage.min_group_size,
        "model.sampling.num_generations",
        f">= {advantage.min_group_size} with model.advantage_estimator {estimator} (its baseline is taken over each prompt's responses)",
        sampling.num_generations,
    )
    # A group baseline subtracts the mean of a prompt's responses: identical responses, identical
    # rewards, every advantage 0 and nothing learnt.
    require(
        sampling.do_sample or advantage.min_group_size < 2,
        "model.sampling.do_sample",
        f"true with model.advantage_estimator {estimator} (greedy decoding gives every response of a group the same text: "
        "every advantage is 0 and the policy never changes)",
        sampling.do_sample,
    )
    if advantage.min_group_size >= 2 and sampling.temperature < GREEDY_TEMPERATURE:
        rank_zero_warn(
            f"model.sampling.temperature {sampling.temperature} with model.advantage_estimator {estimator}: below {GREEDY_TEMPERATURE} "
            "the responses of a group are mostly identical, so are their rewards, and their advantages are 0 (nothing is learnt from them)"
        )
    check_divergence(plugins["divergence"], kl, sampling, plugins["beta_controller"])
    check_off_policy(off_policy, sampling, plugins["rollout_engine"], plugins["reward_model"])
    check_exploration(sampling, off_policy, plugins["rollout_engine"])
    # A sequence-level divergence's penalty is its own (a score-function reward); the KL estimator only measures.
    kl_warning = plugins["divergence"].per_token and recipes.kl_recipe_warning(
        kl_estimator, kl, ppo, recipes.aggregation_name(plugins["loss_aggregation"]), sampling.max_new_tokens
    )
    for warning in (recipes.off_policy_warning(off_policy.correction, off_policy.max_staleness), kl_warning):
        if warning:
            rank_zero_warn(warning)
    if kl.placement != "reward" and getattr(advantage, "scale", False):
        rank_zero_warn(
            f"model.advantage_estimator {type(advantage).__name__} divides each prompt's advantages by its group's reward std "
            "and the KL loss term is not divided: beta weighs the KL against the reward differently for every prompt, so the "
            "policy converges away from the KL-regularised optimum. Use dr_grpo or rloo with the KL in the loss, or the KL in the reward."
        )
    whiten = ppo.whiten_advantages
    if whiten is None:  # the estimator's default, off whenever the KL is in the loss (see above)
        whiten = advantage.whiten and kl.placement == "reward"
    return {"critic": critic, "ppo": dataclasses.replace(ppo, whiten_advantages=whiten)}


def check_off_policy(off_policy: OffPolicyArgs, sampling: SamplingArgs, engine: Any, reward_model: Any = None) -> None:
    """Asynchronous rollouts (``model.off_policy.max_staleness`` > 0) anchor the PPO ratio at the weights
    that train (the proximal policy: a forward at consumption time), the sampler's log-probs kept as the
    behaviour policy's; and need an engine that samples from a published copy of the weights, and with
    ``score_in_sampler`` a reward backend that may be called from the sampler's thread (``RewardModel.thread_safe``)."""
    if not off_policy.max_staleness:
        unused = ("sampler_timeout_s", "correction", "correction_cap", "score_in_sampler", "trust_band", "inflight_every")
        _warn(unused_settings("model.off_policy.", off_policy, unused, "with model.off_policy.max_staleness 0 (no sampler runs ahead)"))
        return
    _warn(
        off_policy.correction == "none"
        and unused_settings("model.off_policy.", off_policy, ("correction_cap",), "with model.off_policy.correction none")
    )
    _warn(
        off_policy.correction not in trust_regions.TRUST_REGIONS
        and unused_settings("model.off_policy.", off_policy, ("trust_band",), f"with model.off_policy.correction {off_policy.correction}")
    )
    require(
        not off_policy.score_in_sampler or getattr(reward_model, "thread_safe", True),
        "model.off_policy.score_in_sampler",
        f"false with model.reward_model {type(reward_model).__name__}, which runs only in the trainer's thread "
        f"(thread_safe False; with model.off_policy.max_staleness {off_policy.max_staleness} the sampler's thread scores)",
        off_policy.score_in_sampler,
    )
    require(
        sampling.old_logprobs == "forward",
        "model.sampling.old_logprobs",
        f"'forward' with model.off_policy.max_staleness {off_policy.max_staleness} (a stale batch's sampler log-probs are "
        "the behaviour policy's, kept as sampler_logprobs; the PPO ratio's pi_old is the current weights', from one forward)",
        sampling.old_logprobs,
    )
    require(
        engine.samples_stale_weights,
        "model.rollout_engine",
        f"'hf' or 'vllm' with model.off_policy.max_staleness {off_policy.max_staleness} (the engine must sample from a published copy "
        "of the weights; set model.off_policy.max_staleness: 0 for this engine)",
        type(engine).__name__,
    )
    require(
        sampling.rollout_correction == "none",
        "model.sampling.rollout_correction",
        f"'none' with model.off_policy.max_staleness {off_policy.max_staleness} (the stale samples' weights, "
        f"model.off_policy.correction {off_policy.correction}, are from the sampler's own log-probs: they already correct its numerics)",
        sampling.rollout_correction,
    )


def _warn(warning: Optional[str]) -> None:
    if warning:
        rank_zero_warn(warning)


def check_exploration(sampling: SamplingArgs, off_policy: OffPolicyArgs, engine: Any) -> None:
    """Exploration (``model.sampling.explore`` > 0) draws from a mixture the engine must build from the policy's
    logits, and its per-token weights are the only correction of the batch."""
    if not sampling.explore:
        _warn(unused_settings("model.sampling.", sampling, ("explore_iterations",), "with model.sampling.explore 0 (nothing explores)"))
        return
    why = f"with model.sampling.explore {sampling.explore}"
    require(
        engine.draws_exploration,
        "model.rollout_engine",
        f"an engine that draws from the exploring mixture {why} ('hf'; or set model.sampling.explore: 0)",
        type(engine).__name__,
    )
    require(
        off_policy.max_staleness == 0,
        "model.off_policy.max_staleness",
        f"0 {why} (a stale sampler's batch would need both weights, the staleness's and the exploration's; not built)",
        off_policy.max_staleness,
    )
    require(
        sampling.rollout_correction == "none",
        "model.sampling.rollout_correction",
        f"'none' {why} (its per-token weights pi_old / mu are the correction, and 'hf' samples with the trainer's own numerics)",
        sampling.rollout_correction,
    )


def check_reference(reference: Optional[str], reference_update: Any) -> None:
    """``model.reference`` names a model other than the starting policy (a checkpoint folder, a .gguf file or
    ``smollm2``; null: the starting policy). A reference update moves the reference toward the policy's
    weights (``sync``, ``reset``, ``ema``): from another model, the reference would stop being it after its
    first move (and from another architecture no move is defined), so the two are refused together."""
    require(
        reference is None or (isinstance(reference, str) and reference.strip() != ""),
        "model.reference",
        "null (the starting policy) or a checkpoint folder, a .gguf file or smollm2",
        reference,
    )
    require(
        reference is None or not reference_update.moves,
        "model.reference_update",
        f"none with model.reference {reference!r} (a reference update moves the reference toward the policy's weights: the "
        "reference would stop being that model at its first move; to regularise toward a moving copy of the policy, "
        "leave model.reference null)",
        type(reference_update).__name__,
    )


def check_divergence(divergence: Divergence, kl: KLArgs, sampling: SamplingArgs, controller: Any) -> None:
    """A sequence-level divergence (``per_token`` False: every f-divergence but the reverse KL) is the penalty
    -beta f'(u) of the whole response in its reward: refuse the settings that make no sense for it, each named
    (docs/divergences.md, "What each setting means with a divergence")."""
    if divergence.per_token:
        return
    name = f"model.divergence {type(divergence).__name__}"
    require(
        kl.placement == "reward",
        "model.kl.placement",
        f"'reward' with {name} (its penalty -beta f'(u) is of the whole response, a score-function reward; the loss "
        "path carries per-token estimators of the reverse KL only)",
        kl.placement,
    )
    require(
        not kl.ignore_tokens,
        "model.kl.ignore_tokens",
        f"null with {name} (u is the whole response's probability ratio: a token left out of it would make u another number)",
        kl.ignore_tokens,
    )
    require(
        sampling.rollout_correction == "none",
        "model.sampling.rollout_correction",
        f"'none' with {name} (its per-token weights do not weigh the value of a sequence-level penalty)",
        sampling.rollout_correction,
    )
    require(
        controller.unit == "sequence_sum",
        "model.beta_controller.init_args.unit",
        f"'sequence_sum' with {name} (the controller reads objective/divergence, one value per response; a divergence "
        "of the whole response has no per-token mean)",
        controller.unit,
    )
    require(
        not controller.keyed_by_prompt,
        "model.beta_controller",
        f"a controller with one beta with {name} (the per-prompt budgets hold each prompt's reverse KL; a sequence-level "
        "divergence's optimum and controller input are the whole batch's)",
        type(controller).__name__,
    )
