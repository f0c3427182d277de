"""PPO-RLHF with a KL penalty to a frozen reference policy, as one LightningModule.

One ``training_step`` is one PPO iteration on a batch of prompts x:

1. rollout     y ~ pi_theta(. | x), ``num_generations`` responses per prompt: KV-cached ``generate``
               without gradients, sampling from the untruncated policy (top_k = 0, top_p = 1);
               its logits are log pi_old (``old_logprobs: sampler``, default).
2. score       r_RM(x, y) from the reward backend on the decoded text; one batched forward
               each for log pi_ref and a separate critic's V_old (and log pi_old with
               ``old_logprobs: forward``); per-token KL estimate kl_t and per-token reward
               R_t = r_RM * 1[t = T] - beta * kl_t.
3. advantages  the advantage estimator plugin: GAE(gamma, lambda) on R_t and V_old, whitened over
               the global batch (default), or a critic-free group / batch baseline (grpo, rloo, ...).
4. update      ppo_epochs passes over num_minibatches: the policy-loss plugin (PPO's clipped
               surrogate by default) (+ vf_coef * clipped value loss with a critic) (+ beta * kl_t
               as a loss term when kl_penalty is 'loss'/'both') (- an entropy bonus), each per-token
               term summed with the loss-aggregation plugin's weights (a token mean by default).

Then the beta controller sees the global mean KL (in its declared unit) and updates beta (and an
entropy controller, if any, the entropy bonus's coefficient), and the reference update plugin
may move the reference toward the policy (default ``none``: the reference stays the frozen
starting policy; ``sync``, ``reset`` or ``ema`` every N iterations).

On a CPU every step runs its fp32 linear layers through oneDNN (``cpu_linear``, cpu.py).

Left out on purpose: reward-model training (tools/) and any home-made distributed code: every
cross-rank statistic goes through the Lightning strategy's ``reduce``.
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
from dataclasses import dataclass
from typing import Literal, Optional, TypedDict, Union

import torch
from lightning import LightningModule
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MeanMetric

from rlhf_lightning import cpu, fsdp2
from rlhf_lightning import ppo_math as pm
from rlhf_lightning.interfaces import (
    AdvantageEstimator,
    BetaController,
    ConfigError,
    KLEstimator,
    LossAggregation,
    PolicyLoss,
    ReferenceUpdate,
    RewardModel,
    finite_number,
    require,
)
from rlhf_lightning.models import ValueModel, frozen_copy, load_causal_lm, load_tokenizer, move_toward
from rlhf_lightning.registry import class_path, registry

# The frozen reference copy is in eval mode on purpose (dropout is off everywhere anyway).
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")

REFERENCE_ADAPTER = "reference"  # LoRA: the moving reference's own frozen adapter beside "default"
UPDATE_STATS = ("policy/loss", "policy/clipfrac", "policy/approxkl", "value/loss", "value/clipfrac", "policy/kl_loss", "policy/entropy")


@dataclass
class Rollout:
    """Everything one iteration learns from. Per-token tensors are (batch, response_len)."""

    prompts: list[str]
    responses: list[str]
    input_ids: Tensor  # (batch, prompt_len + response_len): prompt then response
    attention_mask: Tensor  # same shape: the tokenizer's prompt mask, then the response mask
    response: Tensor  # response token ids
    mask: Tensor  # 1 on real response tokens, up to and including the first EOS
    ended_with_eos: Tensor  # (batch,) bool
    old_logprobs: Tensor  # log pi_old of the sampled tokens: the policy that sampled them
    ref_logprobs: Tensor
    old_values: Optional[Tensor]  # V_old(s_t), the critic's values at sampling time; None without a critic
    entropy: Tensor  # of pi_old at each response position
    ref_logits: Optional[Tensor] = None  # (batch, response_len, vocab), only when the estimator needs it
    old_logits: Optional[Tensor] = None  # pi_old's, like ref_logits
    initial_logprobs: Optional[Tensor] = None  # log pi_0, only when the reference moves
    initial_logits: Optional[Tensor] = None

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.response.shape[1]


@dataclass
class Scored:
    """The score phase's results. Per-token tensors are (batch, response_len); per-response (batch,)."""

    kl: Tensor  # the penalised per-token KL estimate, zero off the KL mask
    raw_scores: Optional[Tensor]  # r_RM as the backend returned it (None when the backend faulted)
    scores: Optional[Tensor] = None  # r_RM shaped for training (missing-EOS penalty, normalisation, clip)
    rewards: Optional[Tensor] = None  # R_t = r_RM * 1[t = T] - beta * kl_t (the KL only when it is in the reward)
    fault: Optional[str] = None  # why the iteration is skipped: a non-finite reward or KL on some rank


class IterationOutputs(TypedDict):
    """What ``training_step`` returns: callbacks receive it as ``outputs`` in ``on_train_batch_end``."""

    rollout: Rollout
    kl: Tensor  # (batch, response_len), as in Scored
    scores: Optional[Tensor]  # r_RM per response, as the backend returned it
    metrics: dict[str, float]  # the iteration's logged metrics; empty for a skipped iteration
    skipped: bool  # skipped for a fault (non-finite reward or KL): no update, no metrics


class PPORLHF(LightningModule):
    """PPO-RLHF: rollout -> score -> advantages -> update, with a pluggable KL penalty.

    Args:
        policy: model spec: ``tiny``, ``smollm2``, a local HF checkpoint folder or a ``.gguf`` file.
        tokenizer: tokenizer spec; default: the policy's own (``char`` for ``tiny``).
        reward_model: a registered reward backend name, or ``class_path``/``init_args``.
        kl_estimator: a registered KL estimator name (k1, k2, k3, abs, full, ...) or ``class_path``.
        beta_controller: a registered beta controller name (fixed, adaptive, band, ...) or ``class_path``.
        advantage_estimator: a registered advantage estimator name (gae, grpo, dr_grpo, rloo,
            reinforce_pp) or ``class_path``; GAE's gamma and lambda are its own arguments.
        num_generations: responses sampled per prompt; a rollout holds prompts x num_generations
            responses, each prompt's group in consecutive rows on one rank.
        policy_loss: a registered policy loss (ppo_clip, clip_higher, dual_clip, gspo, cispo) or
            ``class_path``; clip ranges are its own arguments.
        loss_aggregation: how per-token losses are averaged (token_mean, seq_mean_token_mean,
            seq_mean_token_sum, constant); null: what the policy loss or the advantage estimator
            is defined with (gspo: seq_mean_token_mean, dr_grpo: constant), else token_mean.
        entropy_coef: a fixed entropy bonus: - entropy_coef * H_t per token in the loss.
        entropy_controller: a beta controller (adaptive, pid, ...) whose beta is the entropy bonus's
            coefficient and whose target is an entropy (in its unit: nats per token or per
            response): the coefficient rises while the rollout's entropy is below the target.
        kl_penalty: where beta * KL goes: into the per-token ``reward`` (PPO-RLHF), a separate
            ``loss`` term (GRPO style), or ``both``.
        kl_loss_weighting: the KL loss term (``loss``/``both``) of tokens sampled from pi_old while
            pi_theta moves over the PPO epochs: ``importance`` weights each token's estimate by
            w_t = pi_theta(y_t) / pi_old(y_t) (ppo_math.importance_weighted_kl: with ``loss`` the
            ratio carries gradient, which makes value-unbiased estimators (k1, k3) follow
            grad KL(pi_theta || pi_ref) at every epoch; with ``both`` it is detached, the reward
            carrying the score-function part); an estimator whose value does not depend on the
            sampled token (``full``) takes no ratio either way. ``none`` differentiates the
            estimate as it is (its on-policy gradient: right for k3+, k1+, k2, full, not for k3 or k1).
        kl_ignore_tokens: tokens left out of the KL penalty wherever they are sampled (e.g.
            ``["<|im_end|>"]``: end-of-turn tokens often dominate the KL); ``eos`` means the EOS token.
        gold_reward_model: an optional second reward backend that is only logged
            (``objective/gold_reward``), to watch a proxy reward being over-optimised.
        max_new_tokens / min_new_tokens / temperature: sampling; log-probs use the same temperature.
        do_sample: sample (PPO) or decode greedily (evaluation; tests that need rollouts that
            depend on the weights alone).
        max_prompt_length: longest rendered prompt in tokens; longer prompts are an error.
        old_logprobs: where log pi_old (and a shared critic's V_old) come from: ``sampler``
            (default, as TRL's PPO), the logits ``generate`` computed while sampling, the very
            distribution the tokens were drawn from: no extra forward pass (~10% of a LoRA
            iteration on CPU), equal to a fresh forward up to float rounding (~1e-6 in fp32, more
            under bf16 autocast, where cached decoding rounds differently); or ``forward``, one
            batched forward of the policy, bit-identical to the update's first forward (so the
            first ratio is exactly 1). Either way the KL to a reference whose weights equal the
            policy's (iteration 0, right after a sync) is exactly 0: its log-probs are then the
            policy's own, and its forward is skipped (``_reference_is_policy``).
        use_chat_template: render prompts with the tokenizer's chat template when it has one.
        special_tokens_in_prompts: ``refuse`` (default) a prompt whose text contains one of the
            tokenizer's special-token strings (``<|im_end|>``, ``<|im_start|>``, ...), which the
            tokenizer would read as real special tokens, so a prompt file could forge chat turns;
            ``allow`` for prompts that are pre-rendered chat text on purpose.
        ppo_epochs / num_minibatches / gradient_accumulation_steps: passes over each rollout,
            minibatches per pass (one optimizer step each), micro-batches per minibatch.
        cliprange_value: the value clip. vf_coef: value-loss weight.
        whiten_advantages: whiten the advantages over the global batch; null: the estimator's
            default (gae: yes; the critic-free estimators normalise their own way: no), and no
            whenever the KL is in the loss (true is refused there: see the check below).
        lr / critic_lr / weight_decay / max_grad_norm: AdamW settings and gradient clipping.
        optimizers: ``separate`` (one AdamW for the policy, one for the critic) or ``shared``.
        critic: the value head's trunk: a ``separate`` copy of the policy's trunk, ``none`` (no
            value head, loss or optimizer: the critic-free estimators), or ``shared``
            with the policy (one forward pass gives log-probs and values; see ValueModel).
            null: ``separate`` for an estimator that needs a critic, else ``none``.
        lora_rank: 0 for full fine-tuning; > 0 trains a LoRA adapter and the reference is the
            same weights with the adapter disabled (no second copy in memory).
        merge_lora_for_generation: merge the adapter into the (fp32) base weights while sampling
            and unmerge after (1.15x -> 1.0x of a plain model's generate time on CPU); each
            merge/unmerge rounds the base weights by at most one ulp.
        reference_update: how the reference moves toward the policy after an iteration: ``none``
            (frozen, the default), ``sync`` / ``reset`` (ref <- policy every N iterations; reset also
            clears the policy's optimizer state), ``ema`` (ref <- (1 - alpha) ref + alpha policy).
            A moving reference is the frozen copy under full fine-tuning (plus a second frozen copy
            of the starting policy for ``objective/kl_to_initial``: one more model in memory), or a
            second, frozen LoRA adapter under LoRA (the starting policy stays the adapter-disabled
            model: one more adapter in memory). Every rank applies the same update to the same
            weights, so DDP ranks hold the same reference. Its weights are checkpointed once it has moved.
        tiny_config: overrides of the ``tiny`` model's LlamaConfig.
        seed: initialisation seed of the ``tiny`` model.
        cpu_linear: the kernel of fp32 linear layers on a CPU, forward and backward: ``onednn``
            (oneDNN's AVX-512 inner product: 1.4-2x faster than MKL's sgemm on CPUs where MKL
            takes its AVX2 path, such as AMD's), ``aten`` (PyTorch's own: MKL), or ``auto``
            (oneDNN where the torch build has it). Results agree to float rounding (cpu.py).
        cpu_malloc: ``tuned`` (glibc) keeps freed memory in the process for reuse instead of
            handing it back and faulting it in again (5x fewer page faults per update; the process
            keeps its peak heap); ``default`` leaves malloc as it is. Set at start-up (cpu.py).
        max_consecutive_faults: iterations in a row that may be skipped for a non-finite reward,
            KL or loss before the run stops with the cause.
        log_samples_every_n_steps / num_logged_samples: sample table sent to TensorBoard.
    """

    def __init__(
        self,
        policy: str = "tiny",
        tokenizer: Optional[str] = None,
        reward_model: Union[RewardModel, str] = "callable",
        kl_estimator: Union[KLEstimator, str] = "k1",
        beta_controller: Union[BetaController, str] = "fixed",
        advantage_estimator: Union[AdvantageEstimator, str] = "gae",
        num_generations: int = 1,
        policy_loss: Union[PolicyLoss, str] = "ppo_clip",
        loss_aggregation: Union[LossAggregation, str, None] = None,
        entropy_coef: float = 0.0,
        entropy_controller: Union[BetaController, str, None] = None,
        kl_penalty: Literal["reward", "loss", "both"] = "reward",
        kl_loss_weighting: Literal["none", "importance"] = "importance",
        kl_ignore_tokens: Optional[list[str]] = None,
        gold_reward_model: Union[RewardModel, str, None] = None,
        max_new_tokens: int = 32,
        min_new_tokens: int = 0,
        do_sample: bool = True,
        temperature: float = 1.0,
        max_prompt_length: int = 256,
        old_logprobs: Literal["sampler", "forward"] = "sampler",
        use_chat_template: bool = True,
        special_tokens_in_prompts: Literal["refuse", "allow"] = "refuse",
        ppo_epochs: int = 4,
        num_minibatches: int = 1,
        gradient_accumulation_steps: int = 1,
        cliprange_value: float = 0.2,
        vf_coef: float = 0.1,
        whiten_advantages: Optional[bool] = None,
        lr: float = 1e-5,
        critic_lr: Optional[float] = None,
        weight_decay: float = 0.0,
        max_grad_norm: Optional[float] = 1.0,
        optimizers: Literal["separate", "shared"] = "separate",
        critic: Optional[Literal["separate", "shared", "none"]] = None,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: Optional[list[str]] = None,
        merge_lora_for_generation: bool = True,
        reference_update: Union[ReferenceUpdate, str] = "none",
        tiny_config: Optional[dict] = None,
        seed: int = 0,
        trust_remote_code: bool = False,
        cpu_linear: cpu.CpuLinear = "auto",
        cpu_malloc: Literal["tuned", "default"] = "tuned",
        max_consecutive_faults: int = 3,
        log_samples_every_n_steps: int = 10,
        num_logged_samples: int = 4,
    ) -> None:
        super().__init__()
        # Plugins first: an unknown name fails here, before any model loads.
        self.reward_model: RewardModel = registry("reward_model").build(reward_model, "model.reward_model")
        self.kl_estimator: KLEstimator = registry("kl_estimator").build(kl_estimator, "model.kl_estimator")
        self.beta_controller: BetaController = registry("beta_controller").build(beta_controller, "model.beta_controller")
        self.advantage_estimator: AdvantageEstimator = registry("advantage_estimator").build(
            advantage_estimator, "model.advantage_estimator"
        )
        self.policy_loss: PolicyLoss = registry("policy_loss").build(policy_loss, "model.policy_loss")
        self.loss_aggregation: LossAggregation = self._build_loss_aggregation(loss_aggregation)
        require(entropy_coef >= 0 and not (entropy_coef and entropy_controller is not None), "model.entropy_coef",
                ">= 0, and 0 when model.entropy_controller is set", entropy_coef)  # fmt: skip
        if entropy_controller is not None:
            entropy_controller = registry("beta_controller").build(entropy_controller, "model.entropy_controller")
        elif entropy_coef:
            entropy_controller = registry("beta_controller").get("fixed")(init_beta=entropy_coef, unit="token_mean")
        self.entropy_controller: Optional[BetaController] = entropy_controller
        self.gold_reward_model: Optional[RewardModel] = (
            None if gold_reward_model is None else registry("reward_model").build(gold_reward_model, "model.gold_reward_model")
        )
        self.reference_update: ReferenceUpdate = registry("reference_update").build(reference_update, "model.reference_update")
        self._kl_reads_sampled_token = _depends_on_sampled_token(self.kl_estimator)
        require(kl_penalty in ("reward", "loss", "both"), "model.kl_penalty", "one of reward, loss, both", kl_penalty)
        require(kl_loss_weighting in ("none", "importance"), "model.kl_loss_weighting", "'none' or 'importance'", kl_loss_weighting)
        # Whitening divides the advantages (the reward's gradient, and with 'both' the reward's part
        # of the KL's) by their std; a KL loss term is not divided, so beta no longer weighs the KL
        # against the reward as configured (bandit task, k3+ in the loss: gap 0.50 with whitening,
        # 0.001 without; README, "KL in the loss over several PPO epochs").
        require(kl_penalty == "reward" or not whiten_advantages, "model.whiten_advantages",
                "false when the KL is in the loss (kl_penalty: loss or both): whitening rescales the "
                "advantages but not the KL loss term", whiten_advantages)  # fmt: skip
        require(max_new_tokens >= 1, "model.max_new_tokens", ">= 1", max_new_tokens)
        require(0 <= min_new_tokens <= max_new_tokens, "model.min_new_tokens", "in [0, max_new_tokens]", min_new_tokens)
        for name in ("temperature", "cliprange_value", "vf_coef", "lr", "critic_lr", "weight_decay", "max_grad_norm",
                     "lora_alpha", "entropy_coef"):  # fmt: skip
            value = locals()[name]  # YAML's .inf and .nan parse as floats: refuse them here, before any model loads
            require(value is None or finite_number(value), f"model.{name}", "a finite number", value)
        require(vf_coef >= 0 and weight_decay >= 0 and lora_alpha > 0, "model.vf_coef, weight_decay and lora_alpha",
                ">= 0, >= 0 and > 0", (vf_coef, weight_decay, lora_alpha))  # fmt: skip
        require(max_grad_norm is None or max_grad_norm > 0, "model.max_grad_norm", "> 0 or null", max_grad_norm)
        require(temperature > 0, "model.temperature", "> 0", temperature)
        require(old_logprobs in ("sampler", "forward"), "model.old_logprobs", "'sampler' or 'forward'", old_logprobs)
        require(cpu_linear in ("auto", "aten") or (cpu_linear == "onednn" and cpu.onednn_available()), "model.cpu_linear",
                "'auto', 'aten', or 'onednn' where this torch build has oneDNN", cpu_linear)  # fmt: skip
        require(cpu_malloc in ("tuned", "default"), "model.cpu_malloc", "'tuned' or 'default'", cpu_malloc)
        require(special_tokens_in_prompts in ("refuse", "allow"), "model.special_tokens_in_prompts", "'refuse' or 'allow'",
                special_tokens_in_prompts)  # fmt: skip
        for name in ("ppo_epochs", "num_minibatches", "gradient_accumulation_steps", "max_prompt_length", "max_consecutive_faults",
                     "num_generations"):  # fmt: skip
            require(locals()[name] >= 1, f"model.{name}", "an integer >= 1", locals()[name])
        require(cliprange_value > 0, "model.cliprange_value", "> 0", cliprange_value)
        require(lr > 0 and (critic_lr is None or critic_lr > 0), "model.lr and critic_lr", "> 0", (lr, critic_lr))
        require(optimizers in ("separate", "shared"), "model.optimizers", "'separate' or 'shared'", optimizers)
        estimator = type(self.advantage_estimator).__name__
        critic = critic or ("separate" if self.advantage_estimator.needs_critic else "none")
        require(critic in ("separate", "shared", "none"), "model.critic", "'separate', 'shared', 'none' or null", critic)
        require((critic != "none") == self.advantage_estimator.needs_critic, "model.critic",
                f"{'separate or shared' if self.advantage_estimator.needs_critic else 'none'} with "
                f"model.advantage_estimator {estimator}", critic)  # fmt: skip
        require(critic != "none" or (critic_lr is None and optimizers == "separate"), "model.critic_lr and optimizers",
                "unset without a critic (model.critic: none)", (critic_lr, optimizers))  # fmt: skip
        require(num_generations >= self.advantage_estimator.min_group_size, "model.num_generations",
                f">= {self.advantage_estimator.min_group_size} with model.advantage_estimator {estimator} "
                "(its baseline is taken over each prompt's responses)", num_generations)  # fmt: skip
        require(lora_rank >= 0, "model.lora_rank", ">= 0", lora_rank)
        if kl_penalty == "reward" and not self.kl_estimator.unbiased_as_reward:
            rank_zero_warn(
                f"{type(self.kl_estimator).__name__} as a per-token reward gives a biased gradient of the KL "
                "(only k1's score-function gradient is the KL's); the policy converges away from the "
                "KL-regularised optimum. Use kl_estimator k1 in the reward, or this estimator with kl_penalty: loss."
            )
        if kl_penalty == "loss" and kl_loss_weighting == "importance" and not _gradient_follows_value(self.kl_estimator):
            rank_zero_warn(
                f"{type(self.kl_estimator).__name__}'s gradient is not the derivative of its value (a straight-through "
                "estimator such as k3+ already carries the score-function term k * grad log pi that the importance "
                "ratio's gradient adds, so it is counted twice and the policy drifts from the KL-regularised optimum). "
                "Use kl_estimator k3 (or full) with kl_loss_weighting: importance, or this estimator with 'none'."
            )
        self.save_hyperparameters(ignore=[
            "reward_model", "kl_estimator", "beta_controller", "gold_reward_model", "advantage_estimator", "policy_loss",
            "loss_aggregation", "entropy_controller", "reference_update",
        ])  # fmt: skip
        # Stored resolved, so checkpoints and the compatibility check see what was built.
        self.hparams.critic = critic
        if whiten_advantages is None:  # the estimator's default, off whenever the KL is in the loss (see above)
            whiten_advantages = self.advantage_estimator.whiten and kl_penalty == "reward"
        self.hparams.whiten_advantages = whiten_advantages
        self.automatic_optimization = False

        self.tokenizer = load_tokenizer(tokenizer or ("char" if policy == "tiny" else policy), trust_remote_code)
        self.kl_ignore_ids = torch.tensor([self._token_id(t) for t in kl_ignore_tokens or []], dtype=torch.long)
        self.policy: Optional[nn.Module] = None
        self.ref_model: Optional[nn.Module] = None
        self.initial_model: Optional[nn.Module] = None  # full fine-tuning with a moving reference: pi_0
        self.reference_updates = 0  # times the reference has moved (checkpointed)
        self.critic: Optional[ValueModel] = None
        self.update_stats = nn.ModuleDict({name.replace("/", "__"): MeanMetric() for name in UPDATE_STATS})
        self.iteration = 0  # PPO iterations done; global_step counts optimizer steps instead
        self._rng_to_restore: Optional[dict] = None
        self.generation_seed_base = int(torch.initial_seed()) % 2**31  # saved with checkpoints
        self.faults = {"skipped_iterations": 0, "skipped_steps": 0, "consecutive": 0}

    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        hp = self.hparams
        policy = self._load_policy()
        self.critic = None if hp.critic == "none" else ValueModel.from_policy(policy, shared=hp.critic == "shared")
        if hp.lora_rank > 0:
            self.policy = self._add_lora(policy)
        else:
            self.policy = policy
            self.ref_model = frozen_copy(policy)
            self.initial_model = frozen_copy(policy) if self.reference_update.moves else None
        if self.device_mesh is not None:  # ModelParallelStrategy: FSDP2 over the data-parallel mesh
            self._shard_models()

    def _load_policy(self) -> nn.Module:
        """The policy network as configured, without LoRA and unsharded."""
        from transformers import GenerationConfig

        hp = self.hparams
        policy = load_causal_lm(hp.policy, len(self.tokenizer), hp.seed, hp.trust_remote_code, hp.tiny_config).train()
        # Our own generation config, so no checkpoint default (top_k=50, top_p=0.9, ...) truncates sampling
        # (greedy: no sampling flags, which save_pretrained refuses without do_sample).
        sampling = dict(temperature=hp.temperature, top_k=0, top_p=1.0) if hp.do_sample else {}
        policy.generation_config = GenerationConfig(
            do_sample=hp.do_sample, max_new_tokens=hp.max_new_tokens, min_new_tokens=hp.min_new_tokens, **sampling,
            pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
        )  # fmt: skip
        return policy

    def _add_lora(self, policy: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        hp = self.hparams
        config = LoraConfig(
            r=hp.lora_rank, lora_alpha=hp.lora_alpha, lora_dropout=0.0,
            target_modules=hp.lora_target_modules or "all-linear", task_type="CAUSAL_LM",
        )  # fmt: skip
        dtype = next(policy.parameters()).dtype
        require(not hp.merge_lora_for_generation or dtype == torch.float32, "model.merge_lora_for_generation",
               "false when the base weights are not float32 (merging would round them)", f"true with {dtype} weights")  # fmt: skip
        policy = get_peft_model(policy, config)
        if self.reference_update.moves:  # a frozen copy of the (no-op) initial adapter
            with torch.random.fork_rng(devices=[]):  # its random init is overwritten: draw nothing from the run's RNG
                policy.add_adapter(REFERENCE_ADAPTER, config)
            policy.set_requires_grad(REFERENCE_ADAPTER, False)
            move_toward(*_adapter_pairs(policy), 1.0)
        return policy

    def _shard_models(self) -> None:
        """FSDP2: shard the policy (with its LoRA adapters), the critic and the reference (and a
        moving reference's starting policy) per transformer block over the data-parallel mesh.
        The reference is sharded like the policy (it is as large, and it runs one no-grad forward
        per iteration: one gather per block); with LoRA it is the policy itself with the adapter
        disabled (or its frozen reference adapter, sharded with its blocks). A moving reference
        moves shard by shard: each rank updates its own shards toward the policy's. Every trainable parameter
        must be under ``fully_shard``: ModelParallelStrategy has no DDP to average the rest."""
        mesh = self.device_mesh
        require(mesh["tensor_parallel"].size() == 1, "trainer.strategy",
                "data-parallel sharding (tensor_parallel_size 1, e.g. rlhf_lightning.fsdp2.FSDP2Strategy)",
                f"tensor_parallel_size {mesh['tensor_parallel'].size()}")  # fmt: skip
        mesh = mesh["data_parallel"]
        # With LoRA the base model is the FSDP root: generation calls it directly (see _generator).
        fsdp2.shard(self.policy.get_base_model() if self.hparams.lora_rank else self.policy, mesh)
        for model in (self.critic, self.ref_model, self.initial_model):
            if model is not None:
                fsdp2.shard(model, mesh, frozen=model is not self.critic)

    def configure_optimizers(self):
        hp = self.hparams
        policy_params = [p for p in self.policy.parameters() if p.requires_grad]
        # fused: one kernel per step instead of a dozen per tensor (2-3x faster steps on CPU). Not under
        # 16-mixed/bf16-mixed: Lightning refuses to clip a fused optimizer's gradients there (it could
        # unscale them itself), so the multi-tensor (foreach) AdamW steps instead.
        fused = not (self._trainer is not None and isinstance(self.trainer.precision_plugin, MixedPrecision))
        if self.critic is None:
            return torch.optim.AdamW(policy_params, lr=hp.lr, weight_decay=hp.weight_decay, fused=fused)
        critic_params = list(self.critic.parameters())
        critic_lr = hp.critic_lr or hp.lr
        if hp.optimizers == "shared":
            return torch.optim.AdamW(
                [{"params": policy_params, "lr": hp.lr}, {"params": critic_params, "lr": critic_lr}],
                weight_decay=hp.weight_decay,
                fused=fused,
            )
        return [
            torch.optim.AdamW(policy_params, lr=hp.lr, weight_decay=hp.weight_decay, fused=fused),
            torch.optim.AdamW(critic_params, lr=critic_lr, weight_decay=hp.weight_decay, fused=fused),
        ]

    def on_fit_start(self) -> None:
        self._setup_reward_models()
        if isinstance(self.logger, TensorBoardLogger) and self.global_rank == 0:
            self.logger.experiment.add_custom_scalars(self._tensorboard_layout())

    def _setup_reward_models(self) -> None:
        self.reward_model.setup(self.device)
        if self.gold_reward_model is not None:
            self.gold_reward_model.setup(self.device)

    on_validation_start = on_test_start = _setup_reward_models

    def _tensorboard_layout(self) -> dict:
        """TensorBoard's Custom Scalars page, the first view worth opening: reward, the KL the
        controller sees beside its target, beta, the largest per-response KL and the entropy."""
        kl = "objective/kl" if self.beta_controller.unit == "sequence_sum" else "objective/kl_per_token"
        charts = {
            "reward": ["objective/reward", "objective/gold_reward", "val/reward"],
            f"KL ({self.beta_controller.unit}) and the controller's target": [kl, "objective/kl_target"],
            "beta": ["objective/beta"],
            "KL max (nats per response)": ["objective/kl_max"],
            "entropy (nats per token)": ["objective/entropy"],
        }
        return {"rlhf-lightning": {title: ["Multiline", [f"^{tag}$" for tag in tags]] for title, tags in charts.items()}}

    def on_train_start(self) -> None:
        # What this rank holds of policy, critic and reference: its shards under FSDP2.
        self.param_numel_local = fsdp2.local_numel(self.policy, self.critic, self.ref_model, self.initial_model)
        for logger in self.loggers:
            logger.log_metrics({"memory/param_numel_local": float(self.param_numel_local)}, step=self.iteration)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # Lightning logs, at each step, every step value it still holds from earlier steps: a skipped
        # iteration would repeat the previous one's metrics at its own step (tests/test_faults.py).
        if self.trainer._results is not None:
            self.trainer._results.reset(metrics=False, fx="training_step")
        if self._rng_to_restore is not None:
            _set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None

    # ------------------------------------------------------------------ the loop
    def training_step(self, prompts: list[str], batch_idx: int) -> IterationOutputs:
        """One PPO iteration. What it returns reaches callbacks' ``on_train_batch_end`` as ``outputs``."""
        beta, timer = self.current_beta(), _Timer(self.device)
        with self.linear_kernels():
            rollout = self.rollout(self.repeat_prompts(prompts), timer)
            with timer("score"):
                scored = self.score(rollout, beta)
            if scored.fault is not None:  # on some rank: every rank skips together, or collectives would hang
                return self.skip_iteration(rollout, scored)
            with timer("update"):
                advantages, returns = self.compute_advantages(scored.rewards, rollout)
                skipped_steps = self.ppo_update(rollout, advantages, returns, beta)
        return self.end_iteration(rollout, scored, beta, skipped_steps, timer)

    def repeat_prompts(self, prompts: list[str]) -> list[str]:
        """Each prompt ``num_generations`` times, its group in consecutive rows of this rank's batch."""
        self._check_batch_split(len(prompts))
        return [prompt for prompt in prompts for _ in range(self.hparams.num_generations)]

    def current_beta(self) -> float:
        """The controller's beta for this iteration, checked: a plugin's output the loop relies on."""
        beta = self.beta_controller.beta
        require(finite_number(beta) and beta >= 0, f"the beta of beta controller {type(self.beta_controller).__name__}",
                "a finite number >= 0", beta)  # fmt: skip
        return float(beta)

    def score(self, rollout: Rollout, beta: float) -> Scored:
        """r_RM from the reward backend, the per-token KL estimate, and the per-token rewards
        R_t = r_RM * 1[t = T] - beta * kl_t (the KL term only when the penalty is in the reward).
        A non-finite reward or KL on any rank is a fault, named in ``Scored.fault``."""
        kl, raw_scores, fault = self.kl_per_token(rollout), None, None
        try:
            raw_scores = self.reward_model.checked_scores(rollout.prompts, rollout.responses)
        except FloatingPointError as err:
            fault = str(err)
        if fault is None and not torch.isfinite(kl).all():
            fault = f"the {type(self.kl_estimator).__name__} KL estimate is not finite"
        if self._any_rank(fault is not None):
            return Scored(kl, raw_scores, fault=fault or "a non-finite reward or KL on another rank")
        scores = self.reward_model.shape_scores(raw_scores, rollout.ended_with_eos, sum_fn=self._reduce)
        kl_in_reward = kl if self._kl_in_reward else torch.zeros_like(kl)
        return Scored(kl, raw_scores, scores, pm.token_rewards(scores.to(self.device), kl_in_reward, rollout.mask, beta))

    def skip_iteration(self, rollout: Rollout, scored: Scored) -> IterationOutputs:
        """Count a faulty iteration (weights untouched) and log it as skipped, without stale metrics."""
        self.iteration += 1
        self._record_fault(scored.fault, iteration_skipped=True)
        return {"rollout": rollout, "kl": scored.kl, "scores": scored.raw_scores, "metrics": {}, "skipped": True}

    def end_iteration(self, rollout: Rollout, scored: Scored, beta: float, skipped_steps: int, timer: _Timer) -> IterationOutputs:
        """The iteration's metrics (README, "Metrics"), the beta and entropy controllers' updates,
        fault counting, logging, the sample table and the reference update."""
        metrics = self.rollout_metrics(rollout, scored, beta)
        n_samples = int(metrics["response/count"])
        observed = metrics["objective/kl"] if self.beta_controller.unit == "sequence_sum" else metrics["objective/kl_per_token"]
        self.beta_controller.update(observed, n_samples=n_samples)
        if self.entropy_controller is not None:
            metrics["objective/entropy_coef"] = self.entropy_controller.beta
            self._update_entropy_controller(metrics, n_samples)
        self.iteration += 1
        if skipped_steps:
            self._record_fault(f"non-finite PPO loss: {skipped_steps} optimizer step(s) skipped", iteration_skipped=False,
                               steps=skipped_steps)  # fmt: skip
        else:
            self.faults["consecutive"] = 0
        metrics.update(self._fault_metrics(iteration_skipped=False))
        metrics.update(self.consume_update_stats())
        metrics.update({f"timing/{k}_s": v for k, v in timer.seconds.items()})
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(rollout.prompts))
        for key, label in (("objective/reward", "reward"), ("objective/kl", "kl"), ("objective/beta", "beta")):
            self.log(label, metrics[key], prog_bar=True, logger=False, on_step=True, batch_size=len(rollout.prompts))
        if self.hparams.log_samples_every_n_steps and self.step % self.hparams.log_samples_every_n_steps == 0:
            self.log_samples(rollout, scored.raw_scores, scored.kl)
        self.update_reference()
        return {"rollout": rollout, "kl": scored.kl, "scores": scored.raw_scores, "metrics": metrics, "skipped": False}

    @torch.no_grad()
    def rollout(self, prompts: list[str], timer: Optional["_Timer"] = None) -> Rollout:
        """Sample one response per prompt (timed as ``rollout``), then log pi_old and V_old (from
        the sampler's logits, or a batched forward) and log pi_ref (one batched forward of the
        reference), timed as ``forward``."""
        timer = timer or _Timer(self.device)
        enc = self.encode_prompts(prompts)
        from_sampler = self.hparams.old_logprobs == "sampler"
        # Sampling draws from its own seed per (run, rank, iteration): ranks sample independently,
        # and a resumed run draws the same responses without any generator state to restore.
        with timer("rollout"), torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.generation_seed_base + 7919 * self.global_rank + 104729 * self.iteration)
            with self._generator() as generator:
                # synced_gpus=False: with gathered weights generate runs no collective (see _generator),
                # so each rank may stop at its own EOS.
                out = generator.generate(**enc, return_dict_in_generate=True, output_logits=from_sampler,
                                         output_hidden_states=from_sampler and self._shared_critic, synced_gpus=False)  # fmt: skip
        sequences = out.sequences  # (batch, prompt_len + new), right-padded with pad
        prompt_len = enc["input_ids"].shape[1]
        response = sequences[:, prompt_len:]
        mask = pm.response_mask(response, self.tokenizer.eos_token_id)
        ended = ((response == self.tokenizer.eos_token_id) & mask.bool()).any(-1)
        attention_mask = torch.cat([enc["attention_mask"], mask.to(enc["attention_mask"].dtype)], dim=1)
        # Padding after EOS becomes pad tokens, whatever the sampler wrote there.
        response = torch.where(mask.bool(), response, torch.full_like(response, self.tokenizer.pad_token_id))
        input_ids = torch.cat([enc["input_ids"], response], dim=1)
        keep_logits = self.kl_estimator.needs_logits
        with timer("forward"):
            if from_sampler:
                logits, values = self._sampler_outputs(out, input_ids, attention_mask, response.shape[1])
            else:
                logits, values = self.policy_outputs(input_ids, attention_mask, response.shape[1])
            if self._reference_is_policy():  # the same function: the log-probs just computed, and a KL of exactly 0
                ref_logits = logits
            else:
                with self._reference() as ref:
                    ref_logits = self.response_logits(ref, input_ids, attention_mask, response.shape[1])
            initial_logits = None
            if self.reference_update.moves:  # the starting policy, for objective/kl_to_initial
                with self._initial() as initial:
                    initial_logits = self.response_logits(initial, input_ids, attention_mask, response.shape[1])
        return Rollout(
            prompts=list(prompts),
            responses=self.tokenizer.batch_decode(response, skip_special_tokens=True),
            input_ids=input_ids,
            attention_mask=attention_mask,
            response=response,
            mask=mask,
            ended_with_eos=ended,
            old_logprobs=pm.logprobs_of(logits, response),
            ref_logprobs=pm.logprobs_of(ref_logits, response),
            old_values=None if values is None else values * mask,
            entropy=pm.entropy_of(logits),
            old_logits=logits if keep_logits else None,
            ref_logits=ref_logits if keep_logits else None,
            initial_logprobs=None if initial_logits is None else pm.logprobs_of(initial_logits, response),
            initial_logits=initial_logits if keep_logits else None,
        )

    def kl_per_token(self, rollout: Rollout, to_initial: bool = False) -> Tensor:
        """The penalised per-token KL estimate (batch, response_len), zero off the KL mask; with
        ``to_initial`` the same estimate against the starting policy (a moving reference only)."""
        if to_initial:
            kl = self.kl_estimator(rollout.old_logprobs, rollout.initial_logprobs, rollout.old_logits, rollout.initial_logits)
        else:
            kl = self.kl_estimator(rollout.old_logprobs, rollout.ref_logprobs, rollout.old_logits, rollout.ref_logits)
        shape = tuple(rollout.old_logprobs.shape)
        got = f"{type(kl).__name__} {tuple(kl.shape)} {kl.dtype}" if isinstance(kl, Tensor) else type(kl).__name__
        require(isinstance(kl, Tensor) and tuple(kl.shape) == shape and kl.is_floating_point(),
                f"the output of KL estimator {type(self.kl_estimator).__name__}",
                f"a floating-point tensor of shape (batch, response_len) = {shape}", got)  # fmt: skip
        return pm.masked_select(kl, self.kl_mask(rollout.response, rollout.mask))

    def kl_mask(self, response: Tensor, mask: Tensor) -> Tensor:
        """The response mask without the positions of ``kl_ignore_tokens``."""
        if not len(self.kl_ignore_ids):
            return mask
        return mask * ~torch.isin(response, self.kl_ignore_ids.to(response.device))

    def _token_id(self, token: str) -> int:
        if token == "eos":
            return self.tokenizer.eos_token_id
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        require(token_id is not None and token_id != self.tokenizer.unk_token_id, "each of model.kl_ignore_tokens",
                "'eos' or a single token of this tokenizer", token)  # fmt: skip
        return token_id

    def compute_advantages(self, rewards: Tensor, rollout: Rollout) -> tuple[Tensor, Optional[Tensor]]:
        """The advantage estimator on the per-token rewards (and V_old with a critic), checked,
        then whitened over the global batch when ``whiten_advantages``."""
        estimator = self.advantage_estimator
        advantages, returns = estimator(rewards, rollout.mask, rollout.old_values, self.hparams.num_generations, self._reduce)
        expected = (tuple(rewards.shape), tuple(rewards.shape) if estimator.needs_critic else None)
        got = (tuple(advantages.shape), None if returns is None else tuple(returns.shape))
        require(got == expected, f"the (advantages, returns) shapes of advantage estimator {type(estimator).__name__}",
                f"{expected}: (batch, response_len), and returns only when it needs a critic", got)  # fmt: skip
        if self.hparams.whiten_advantages:
            advantages = pm.masked_whiten(advantages, rollout.mask, sum_fn=self._reduce)
        return advantages, returns

    def ppo_update(self, rollout: Rollout, advantages: Tensor, returns: Optional[Tensor], beta: float) -> int:
        """All PPO epochs over the rollout, one optimizer step per minibatch. Returns how many steps
        were skipped because a loss was not finite on some rank (gradients dropped, weights untouched)."""
        hp = self.hparams
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        skipped = 0
        for _ in range(hp.ppo_epochs):
            order = torch.randperm(rollout.input_ids.shape[0], device=self.device)
            for minibatch in order.chunk(hp.num_minibatches):
                if self._accumulate_gradients(rollout, advantages, returns, minibatch, beta):
                    for opt in optimizers:
                        if hp.max_grad_norm:
                            self.clip_gradients(opt, gradient_clip_val=hp.max_grad_norm, gradient_clip_algorithm="norm")
                        opt.step()
                else:
                    skipped += 1
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
        return skipped

    def _accumulate_gradients(
        self, rollout: Rollout, advantages: Tensor, returns: Optional[Tensor], minibatch: Tensor, beta: float
    ) -> bool:
        """Backward over the minibatch's micro-batches; False (and stop) at a non-finite loss."""
        size = len(minibatch) // self.hparams.gradient_accumulation_steps
        # The loss of the minibatch is sum w * loss_t over all its tokens on all ranks, with the
        # aggregation's weights w (global denominators), times the world size that DDP divides by.
        weights = self.loss_aggregation.weights(rollout.mask[minibatch], self.hparams.max_new_tokens, self._reduce)
        weights = weights * self.trainer.world_size
        micro_batches = list(zip(minibatch.split(size), weights.split(size)))
        for i, (idx, micro_weights) in enumerate(micro_batches):
            with self._no_grad_sync(last=i == len(micro_batches) - 1):
                loss = self.ppo_loss(rollout, advantages, returns, idx, beta, micro_weights)
                if self._any_rank(not torch.isfinite(loss)):
                    return False
                self.manual_backward(loss)
        return True

    def ppo_loss(
        self, rollout: Rollout, advantages: Tensor, returns: Optional[Tensor], idx: Tensor, beta: float, weights: Tensor
    ) -> Tensor:
        """On the rows ``idx``: the policy loss (+ vf_coef * clipped value loss with a critic)
        (+ beta * KL in the loss) (- entropy bonus), each per-token term summed with ``weights``."""
        hp = self.hparams
        input_ids, attention_mask, mask = rollout.input_ids[idx], rollout.attention_mask[idx], rollout.mask[idx]
        response_len = rollout.response.shape[1]
        logits, values = self.policy_outputs(input_ids, attention_mask, response_len)
        logprobs = pm.logprobs_of(logits, rollout.response[idx])
        pg_loss, clipped = self.policy_loss(logprobs, rollout.old_logprobs[idx], advantages[idx], mask)
        loss = (weights * pg_loss).sum()
        stats = {"policy/loss": pm.masked_mean(pg_loss, mask), "policy/clipfrac": pm.masked_mean(clipped, mask),
                 "policy/approxkl": pm.approx_kl(logprobs, rollout.old_logprobs[idx], mask)}  # fmt: skip
        if values is not None:
            vf = pm.value_loss_terms(values, rollout.old_values[idx], returns[idx], mask, hp.cliprange_value)
            loss = loss + hp.vf_coef * (weights * vf.loss).sum()
            stats.update({"value/loss": pm.masked_mean(vf.loss, mask), "value/clipfrac": pm.masked_mean(vf.clipped, mask)})
        if hp.kl_penalty in ("loss", "both"):
            ref_logits = rollout.ref_logits[idx] if rollout.ref_logits is not None else None
            kl_mask = self.kl_mask(rollout.response[idx], mask)
            kl = self.kl_estimator(logprobs, rollout.ref_logprobs[idx], logits, ref_logits)
            # The ratio corrects the sampling of y_t: an estimator that sums over the vocabulary at t
            # (full) does not depend on y_t and takes none. Its gradient only where no reward carries
            # k's score term.
            if hp.kl_loss_weighting == "importance" and self._kl_reads_sampled_token:
                kl = pm.importance_weighted_kl(kl, logprobs, rollout.old_logprobs[idx], mask, ratio_gradient=hp.kl_penalty == "loss")
            kl = pm.masked_select(kl, kl_mask)
            loss = loss + beta * (weights * kl).sum()
            stats["policy/kl_loss"] = pm.masked_mean(kl, kl_mask)
        if self.entropy_controller is not None and self.entropy_controller.beta:
            entropy = pm.masked_select(pm.entropy_of(logits), mask)
            loss = loss - self.entropy_controller.beta * (weights * entropy).sum()
            stats["policy/entropy"] = pm.masked_mean(entropy, mask)
        for name, value in stats.items():
            self.update_stats[name.replace("/", "__")].update(value.detach().float())
        return loss

    # ------------------------------------------------------------------ pieces
    def check_prompt_text(self, prompts: list[str], field: str = "the prompts") -> None:
        """Prompt text is data: refuse (unless ``special_tokens_in_prompts: allow``) a prompt that
        contains a special-token string, which the tokenizer would turn into the special token itself."""
        if self.hparams.special_tokens_in_prompts == "allow":
            return
        tok = self.tokenizer
        specials = sorted({t for t in (*tok.all_special_tokens, *tok.get_added_vocab()) if len(t) > 1})
        for i, prompt in enumerate(prompts):
            found = [t for t in specials if t in prompt]
            if found:
                raise ConfigError(
                    f"{field}: prompt {i} ({prompt[:60]!r}) contains the special token string(s) {found}, which would be "
                    "tokenised as real special tokens (a forged chat turn or end of turn); remove them, or set "
                    "model.special_tokens_in_prompts: allow for pre-rendered chat text"
                )

    def setup(self, stage: str) -> None:
        """At start-up, before any model loads: the batch split and every prompt of the data
        module's files (special-token strings, rendered length); the CPU allocator's tuning."""
        if self.hparams.cpu_malloc == "tuned":
            cpu.tune_malloc()
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if stage == "fit" and getattr(datamodule, "batch_size", None):
            self._check_batch_split(datamodule.batch_size)
        for name in ("train_prompts", "val_prompts"):
            if getattr(datamodule, name, None):
                self.encode_prompts(getattr(datamodule, name), f"data.{name.split('_')[0]}_path")

    def encode_prompts(self, prompts: list[str], field: str = "the prompts") -> dict[str, Tensor]:
        """Render (chat template when available) and left-pad; masks come from the tokenizer. A
        prompt with a special-token string, or longer than ``max_prompt_length``, is an error naming ``field``."""
        self.check_prompt_text(prompts, field)
        tok = self.tokenizer
        use_template = self.hparams.use_chat_template and getattr(tok, "chat_template", None)
        if use_template:
            texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts]
        else:
            texts = list(prompts)
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not use_template)
        lengths = enc["attention_mask"].sum(-1)
        too_long = (lengths > self.hparams.max_prompt_length).nonzero().flatten().tolist()
        if too_long:
            i = too_long[0]
            raise ConfigError(
                f"{field}: prompt {i} ({prompts[i][:60]!r}...) is {int(lengths[i])} tokens, longer than "
                f"model.max_prompt_length={self.hparams.max_prompt_length} ({len(too_long)} such prompts)"
            )
        return {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

    def response_logits(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_len: int, return_hidden: bool = False):
        """Temperature-scaled logits predicting each response token: (batch, response_len, vocab);
        with ``return_hidden`` also the last hidden states at those positions (batch, response_len, hidden)."""
        out = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=_position_ids(attention_mask),
            use_cache=False, logits_to_keep=response_len + 1, output_hidden_states=return_hidden,
        )  # fmt: skip
        logits = out.logits[:, :-1].float() / self.hparams.temperature
        if return_hidden:
            return logits, out.hidden_states[-1][:, -response_len - 1 : -1]
        return logits

    def policy_outputs(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> tuple[Tensor, Optional[Tensor]]:
        """Policy logits and critic values V(s_t) before each response token, (batch, response_len);
        values are None without a critic."""
        if self.critic is None:
            return self.response_logits(self.policy, input_ids, attention_mask, response_len), None
        if self._shared_critic:  # one forward pass gives both
            logits, hidden = self.response_logits(self.policy, input_ids, attention_mask, response_len, True)
            return logits, self.critic(hidden=hidden)
        logits = self.response_logits(self.policy, input_ids, attention_mask, response_len)
        return logits, self._critic_values(input_ids, attention_mask, response_len)

    def _critic_values(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> Tensor:
        """A separate critic's V(s_t) before each response token, (batch, response_len)."""
        values = self.critic(input_ids, attention_mask, _position_ids(attention_mask))
        return values[:, -response_len - 1 : -1]

    def _sampler_outputs(self, out, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> tuple[Tensor, Optional[Tensor]]:
        """``policy_outputs`` from what ``generate`` already computed: its raw logits at each step,
        and (shared critic) the last hidden state that produced them; a separate critic still
        runs its own forward."""
        logits = torch.stack(out.logits, dim=1).float() / self.hparams.temperature
        if self.critic is None:
            return logits, None
        if self._shared_critic:  # step 0 holds the whole prompt, later steps one position
            hidden = torch.stack([step[-1][:, -1] for step in out.hidden_states], dim=1)
            return logits, self.critic(hidden=hidden)
        return logits, self._critic_values(input_ids, attention_mask, response_len)

    @contextlib.contextmanager
    def _generator(self):
        """The model that samples. LoRA: the PeftModel's base model, which carries the injected
        LoRA layers (PeftModel.generate measured 4-5x slower on CPU), with the adapter merged into
        the base weights while it samples when ``merge_lora_for_generation`` (no LoRA branch in
        each of the hundreds of decode-step linears; unmerging restores fp32 weights to within
        one rounding step). FSDP2: the policy's full weights are gathered once for the whole
        rollout (``fsdp2.gathered``; a merge then writes into the gathered copy only, and the
        shards stay bit-exact), instead of every block being all-gathered again at each of the
        ``max_new_tokens`` decode steps by FSDP2's forward hooks."""
        with contextlib.ExitStack() as stack:
            if self._sharded:
                stack.enter_context(fsdp2.gathered(fsdp2.fsdp_roots(self.policy)[0]))
            if not self.hparams.lora_rank:
                yield self.policy
                return
            if self.hparams.merge_lora_for_generation:
                self.policy.merge_adapter()
                stack.callback(self.policy.unmerge_adapter)
            yield self.policy.get_base_model()

    def linear_kernels(self):
        """``model.cpu_linear``: on a CPU, fp32 linear layers (every model's, the reward backend's
        too) run through oneDNN inside this context (``cpu.py``: 1.4-2x MKL's AVX2 path)."""
        return cpu.onednn_linear(self.device.type == "cpu" and cpu.resolve_cpu_linear(self.hparams.cpu_linear) == "onednn")

    @contextlib.contextmanager
    def _reference(self):
        """The reference: a separate copy, or the LoRA policy with its adapter disabled (frozen
        reference) or with the reference adapter active instead of the policy's (moving reference)."""
        if self.ref_model is not None:
            yield self.ref_model
        elif self.reference_update.moves:
            self.policy.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
            try:
                yield self.policy
            finally:
                self.policy.set_adapter("default")  # trainable again; the reference adapter stays frozen
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def _build_loss_aggregation(self, spec: Union[LossAggregation, str, None]) -> LossAggregation:
        """``model.loss_aggregation``, or (null) the one the policy loss or the advantage estimator
        is defined with, else token_mean; two different such preferences must be settled by the user."""
        if spec is None:
            preferred = {p for p in (self.policy_loss.loss_aggregation, self.advantage_estimator.loss_aggregation) if p}
            require(len(preferred) <= 1, "model.loss_aggregation",
                    f"set when model.policy_loss {type(self.policy_loss).__name__} and model.advantage_estimator "
                    f"{type(self.advantage_estimator).__name__} are defined with different aggregations", sorted(preferred))  # fmt: skip
            spec = preferred.pop() if preferred else "token_mean"
        return registry("loss_aggregation").build(spec, "model.loss_aggregation")

    def _update_entropy_controller(self, metrics: dict[str, float], n_samples: int) -> None:
        """The entropy controller raises its coefficient while the entropy is below its target: it
        is fed target^2 / H, the entropy mirrored about the target in log space (log(input / target)
        = -log(H / target)), which a KL controller (raising beta while its input exceeds the target)
        turns into exactly that: the same log error with the opposite sign, and never negative."""
        controller = self.entropy_controller
        entropy = metrics["objective/entropy"]  # nats per token
        if controller.unit == "sequence_sum":
            entropy *= metrics["response/length"]
        target = getattr(controller, "target", None)
        controller.update(entropy if target is None else target**2 / max(entropy, 1e-6), n_samples=n_samples)

    @property
    def _sharded(self) -> bool:
        """The models are FSDP2-sharded (ModelParallelStrategy)."""
        return fsdp2.is_sharded(self.policy)

    @property
    def step(self) -> int:
        """The TensorBoard step of the latest iteration, for every record of it (scalars, text,
        images, warnings): its 0-based index, the step Lightning logs the scalars at. Read it once
        the iteration has been counted (``iteration`` is then its 1-based number)."""
        return self.iteration - 1

    @contextlib.contextmanager
    def _initial(self):
        """The starting policy pi_0 beside a moving reference: its frozen copy, or the adapter-disabled LoRA policy."""
        if self.initial_model is not None:
            yield self.initial_model
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def _reference_parameters(self) -> tuple[list[Tensor], list[Tensor]]:
        """The moving reference's parameters and the policy's they move toward, in matching order."""
        if self.ref_model is not None:
            return list(self.ref_model.parameters()), list(self.policy.parameters())
        return _adapter_pairs(self.policy)

    def _reference_is_policy(self) -> bool:
        """Whether the reference computes the policy's very function, its weights equal bit for bit:
        a full copy before the first optimizer step or right after a sync; under LoRA the reference
        adapter equal to the policy's, or the adapter-disabled reference while the policy's adapter
        is still the identity (every lora_B zero: x + 0 = x exactly). Its log-probs are then the
        policy's own (from the sampler or a forward), so the KL is exactly 0 and no reference
        forward runs; compared smallest tensors first, so a trained policy differs within a few."""
        if self.ref_model is not None or self.reference_update.moves:
            pairs = list(zip(*self._reference_parameters()))
        else:
            pairs = [(p, torch.zeros_like(p)) for name, p in self.policy.named_parameters() if ".lora_B.default." in name]
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # FSDP2: each rank its shards
        same = all(torch.equal(local(a), local(b)) for a, b in sorted(pairs, key=lambda pair: pair[0].numel()))
        return not self._any_rank(not same)

    def update_reference(self) -> None:
        """After an iteration, ref <- (1 - alpha) ref + alpha policy when the reference update plugin
        says alpha > 0 for it; a reset also clears the policy parameters' optimizer state."""
        alpha = self.reference_update.weight(self.iteration)
        if not alpha:
            return
        if self._sharded:  # each rank moves its own shards (not a root's copy still gathered from a forward)
            fsdp2.reshard(self.policy, self.ref_model)
        move_toward(*self._reference_parameters(), alpha)
        self.reference_updates += 1
        if self.reference_update.reset_optimizer:
            policy_params = {p for p in self.policy.parameters() if p.requires_grad}
            for opt in self.trainer.optimizers:
                for param in [p for p in opt.state if p in policy_params]:
                    del opt.state[param]

    @property
    def _shared_critic(self) -> bool:
        """A value head on the policy's own hidden states (no trunk of its own)."""
        return self.critic is not None and self.critic.trunk is None

    @property
    def _kl_in_reward(self) -> bool:
        return self.hparams.kl_penalty in ("reward", "both")

    def _reduce(self, t: Tensor, op: Literal["sum", "max"] = "sum") -> Tensor:
        """``t`` summed (or maxed) over all ranks, through the strategy; ``t`` itself on one process."""
        if self._trainer is None or self.trainer.world_size == 1:
            return t
        return self.trainer.strategy.reduce(t.to(self.device), reduce_op=op).to(t.device)

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank."""
        return bool(self._reduce(torch.tensor(float(flag), device=self.device)) > 0)

    def _record_fault(self, cause: str, iteration_skipped: bool, steps: int = 0) -> None:
        """Count and report a skipped iteration or update; stop after too many in a row."""
        self.faults["skipped_iterations"] += int(iteration_skipped)
        self.faults["skipped_steps"] += steps
        self.faults["consecutive"] += 1
        rank_zero_warn(f"iteration {self.step}: {cause}; skipped (weights untouched)")
        if iteration_skipped:  # only the fault counts: no metric of an iteration that did not happen
            self.log_dict(self._fault_metrics(iteration_skipped=True), on_step=True, on_epoch=False, batch_size=1)
        if self.faults["consecutive"] >= self.hparams.max_consecutive_faults:
            raise RuntimeError(
                f"stopping: {self.faults['consecutive']} iterations in a row had faults "
                f"(model.max_consecutive_faults={self.hparams.max_consecutive_faults}); last cause: {cause}"
            )

    def _fault_metrics(self, iteration_skipped: bool) -> dict[str, float]:
        """``faults/iteration_skipped`` (1 at a skipped iteration's step, else 0) and the running counts."""
        counts = {f"faults/{k}": float(v) for k, v in self.faults.items() if k != "consecutive"}
        return {"faults/iteration_skipped": float(iteration_skipped), **counts}

    def _no_grad_sync(self, last: bool):
        """Skip DDP's gradient all-reduce on all but the last micro-batch of a minibatch."""
        if last or self._trainer is None or not hasattr(self.trainer.strategy, "block_backward_sync"):
            return contextlib.nullcontext()
        return self.trainer.strategy.block_backward_sync()

    def _check_batch_split(self, batch_size: int) -> None:
        hp = self.hparams
        parts = hp.num_minibatches * hp.gradient_accumulation_steps
        require(batch_size * hp.num_generations % parts == 0, "data.batch_size * model.num_generations",
                f"divisible by model.num_minibatches * model.gradient_accumulation_steps = {hp.num_minibatches} * "
                f"{hp.gradient_accumulation_steps}", f"{batch_size} * {hp.num_generations}")  # fmt: skip

    # ------------------------------------------------------------------ metrics
    def rollout_metrics(self, rollout: Rollout, scored: Scored, beta: float) -> dict[str, float]:
        """Global (all-rank) means of what the rollout saw; names are documented in the README."""
        mask, kl, raw_scores, scores = rollout.mask, scored.kl, scored.raw_scores, scored.scores
        kl_seq = kl.sum(-1)
        sums = self._reduce(torch.stack([
            torch.tensor(float(len(raw_scores)), device=self.device),
            raw_scores.to(self.device).sum(), scores.to(self.device).sum(), kl_seq.sum(), kl.sum(), mask.sum(),
            (rollout.entropy * mask).sum(), rollout.ended_with_eos.float().sum(),
        ]).double())  # fmt: skip
        n, reward, reward_trained, kl_total, kl_tokens, n_tokens, entropy, n_eos = sums.tolist()
        kl_mean = kl_total / n
        kl_to_initial = kl_mean  # the same estimate against pi_0, which is the reference unless it moves
        if rollout.initial_logprobs is not None:
            kl_to_initial = float(self._reduce(self.kl_per_token(rollout, to_initial=True).sum().double().to(self.device))) / n
        gold = {}
        if self.gold_reward_model is not None:
            gold_scores = self.gold_reward_model.checked_scores(rollout.prompts, rollout.responses)
            gold = {"objective/gold_reward": float(self._reduce(gold_scores.sum().double().to(self.device))) / n}
        return {
            "objective/reward": reward / n,
            "objective/reward_trained": reward_trained / n,
            "objective/kl": kl_mean,
            "objective/kl_per_token": kl_tokens / n_tokens,
            "objective/kl_max": float(self._reduce(kl_seq.max().double(), op="max")),
            "objective/kl_to_initial": kl_to_initial,
            "reference/updates": float(self.reference_updates),
            "objective/non_score_reward": -beta * kl_mean,
            "objective/net": reward / n - beta * kl_mean,
            "objective/entropy": entropy / n_tokens,
            "objective/beta": beta,
            **({"objective/kl_target": float(self.beta_controller.target)} if hasattr(self.beta_controller, "target") else {}),
            "response/length": n_tokens / n,
            "response/eos_fraction": n_eos / n,
            "response/count": n,
            **gold,
        }

    def consume_update_stats(self) -> dict[str, float]:
        """Means of the update statistics over every micro-batch of this iteration (all ranks)."""
        out = {}
        for key, metric in self.update_stats.items():
            if metric.update_count:
                out[key.replace("__", "/")] = float(metric.compute())
            metric.reset()
        return out

    def log_samples(self, rollout: Rollout, raw_scores: Tensor, kl: Tensor) -> None:
        """A markdown table of prompts, responses, scores and KL, as TensorBoard text."""
        if not isinstance(self.logger, TensorBoardLogger) or self.global_rank != 0:
            return
        rows = ["| prompt | response | score | KL |", "|---|---|---|---|"]
        for i in range(min(self.hparams.num_logged_samples, len(rollout.prompts))):
            cells = [_md(rollout.prompts[i]), _md(rollout.responses[i]), f"{raw_scores[i]:.3f}", f"{kl[i].sum():.3f}"]
            rows.append("| " + " | ".join(cells) + " |")
        self.logger.experiment.add_text("samples", "\n".join(rows), global_step=self.step)

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, prompts: list[str], batch_idx: int) -> None:
        self._evaluate(prompts, "val")

    def test_step(self, prompts: list[str], batch_idx: int) -> None:
        self._evaluate(prompts, "test")

    def _evaluate(self, prompts: list[str], stage: str) -> None:
        with self.linear_kernels():
            rollout = self.rollout(prompts)
            raw_scores, _ = self.reward_model(rollout.prompts, rollout.responses, rollout.ended_with_eos, update_stats=False)
        reward = raw_scores.mean().item()
        kl = self.kl_per_token(rollout).sum(-1).mean().item()
        metrics = {
            f"{stage}/reward": reward,
            f"{stage}/kl": kl,
            f"{stage}/net": reward - self.beta_controller.beta * kl,
            f"{stage}/length": rollout.mask.sum(-1).mean().item(),
        }
        self.log_dict(metrics, batch_size=len(prompts), sync_dist=True)

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rlhf_lightning"] = {
            "iteration": self.iteration,
            "beta_controller": self.beta_controller.state_dict(),
            "entropy_controller": None if self.entropy_controller is None else self.entropy_controller.state_dict(),
            "reward_model": self.reward_model.state_dict(),
            "rng": _rng_states(),
            "generation_seed_base": self.generation_seed_base,
            "faults": dict(self.faults),
            "reference_updates": self.reference_updates,
            "plugins": {name: _plugin_kind(plugin) for name, plugin in self._plugins().items()},
        }
        # The starting policy (and the reference until it first moves) is rebuilt from the config;
        # do not store a second copy of those weights. A LoRA reference adapter is part of the policy.
        # A sharded checkpoint keeps them: the strategy loads every submodule from it directly.
        rebuilt = () if self._sharded else ("initial_model.",) if self.reference_updates else ("initial_model.", "ref_model.")
        for key in [k for k in checkpoint["state_dict"] if k.startswith(rebuilt)]:
            del checkpoint["state_dict"][key]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["rlhf_lightning"]
        self._check_compatible(checkpoint.get("hyper_parameters", {}), state.get("plugins", {}))
        self.iteration = state["iteration"]
        self.generation_seed_base = state["generation_seed_base"]
        self.faults = dict(state["faults"])
        self.reference_updates = state.get("reference_updates", 0)
        for name in ("beta_controller", "entropy_controller", "reward_model"):  # the plugins with state
            if getattr(self, name) is not None:
                _load_plugin_state(name, getattr(self, name), state.get(name))
        # Applied at the next training batch: loading and loader setup in between draw random numbers.
        self._rng_to_restore = state.get("rng")
        for prefix, model in (("ref_model.", self.ref_model), ("initial_model.", self.initial_model)):
            for key, value in ({} if model is None or "state_dict" not in checkpoint else model.state_dict()).items():
                checkpoint["state_dict"].setdefault(prefix + key, value)  # a moved reference comes from the checkpoint
        # The config's optimizer settings (lr, critic_lr, weight_decay) win over those stored beside the
        # Adam moments, which Lightning loads next: a changed learning rate takes effect on resume.
        configured = self.configure_optimizers()
        for saved, optimizer in zip(checkpoint.get("optimizer_states", []), configured if isinstance(configured, list) else [configured]):
            for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
                saved_group.update({key: value for key, value in group.items() if key != "params"})

    def _plugins(self) -> dict:
        """The plugins whose kind is fixed for a run (the gold reward, a measurement only, may change)."""
        return {"reward_model": self.reward_model, "beta_controller": self.beta_controller, "entropy_controller": self.entropy_controller,
                "kl_estimator": self.kl_estimator, "advantage_estimator": self.advantage_estimator, "policy_loss": self.policy_loss,
                "loss_aggregation": self.loss_aggregation, "reference_update": self.reference_update}  # fmt: skip

    def _check_compatible(self, saved: dict, saved_plugins: dict) -> None:
        """Resume semantics: the command line and config are what runs, the checkpoint supplies the
        state. Settings that define the weights, the reference or the optimizers' layout
        (``RESUME_FIXED``) and every plugin's kind must equal the checkpoint's, else a ConfigError
        names each; any other changed setting takes effect and is logged."""
        fixed = [*RESUME_FIXED, "seed"] if self.hparams.policy == "tiny" else RESUME_FIXED  # the tiny model is rebuilt from its seed
        changed = {f: (saved[f], self.hparams[f]) for f in self.hparams if f in saved and saved[f] != self.hparams[f]}
        plugins = {name: _plugin_kind(plugin) for name, plugin in self._plugins().items()}
        differ = [f"model.{f}: checkpoint {old!r}, config {new!r}" for f, (old, new) in changed.items() if f in fixed]
        differ += [f"model.{name}: checkpoint {saved_plugins[name]}, config {kind}" for name, kind in plugins.items()
                   if name in saved_plugins and saved_plugins[name] != kind]  # fmt: skip
        if differ:
            raise ConfigError("checkpoint is incompatible with this config (these settings cannot change on resume); " + "; ".join(differ))
        if changed:
            rank_zero_info("resuming with changed settings (checkpoint -> config): " + "; ".join(
                f"model.{f}: {old!r} -> {new!r}" for f, (old, new) in changed.items()))  # fmt: skip


# Settings that may not change when a run resumes: they define the weights the checkpoint holds,
# the reference rebuilt from the config, or the optimizers whose state it holds.
RESUME_FIXED = ("policy", "tokenizer", "tiny_config", "lora_rank", "lora_alpha", "lora_target_modules", "critic", "optimizers")


def _plugin_kind(plugin) -> Optional[str]:
    return None if plugin is None else class_path(type(plugin))


def _load_plugin_state(name: str, plugin, state) -> None:
    """``plugin.load_state_dict(state)``, or a ConfigError naming the plugin when the checkpoint's
    state does not fit it (a checkpoint from an older version, or a different plugin)."""
    try:
        plugin.load_state_dict(state)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ConfigError(
            f"checkpoint: the saved state of model.{name} does not fit {type(plugin).__name__} ({type(err).__name__}: {err}); "
            "resume with the plugin the checkpoint was trained with"
        ) from None


def _depends_on_sampled_token(estimator: KLEstimator) -> bool:
    """Whether an estimator's value at a position changes with the token sampled there, probed with
    two different tokens under the same logits; false for ``full``, which sums over the vocabulary.
    Estimators that read only log-probs of the sampled token are not probed (true)."""
    if not estimator.needs_logits:
        return True
    generator = torch.Generator().manual_seed(0)
    logits, ref_logits = torch.randn(2, 1, 3, 5, generator=generator, dtype=torch.float64)
    logps, ref_logps = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    first, second = (
        estimator(logps[..., token], ref_logps[..., token], logits, ref_logits) for token in ([0, 1, 2], [3, 4, 0])
    )  # fmt: skip
    return not torch.allclose(first, second)


def _gradient_follows_value(estimator: KLEstimator) -> bool:
    """Whether autograd through ``estimator`` gives the derivative of its value, probed by central
    differences at log-ratios x in [-2, 2]; false for straight-through estimators (k3+, k1+), whose
    gradient is another estimator's. Estimators that need logits are not probed (true)."""
    if estimator.needs_logits:
        return True
    x = torch.linspace(-2.0, 2.0, 9, dtype=torch.float64).unsqueeze(0).requires_grad_()
    ref = torch.zeros_like(x)
    (grad,) = torch.autograd.grad(estimator(x, ref).sum(), x)
    h = 1e-6
    with torch.no_grad():
        derivative = (estimator(x + h, ref) - estimator(x - h, ref)) / (2 * h)
    return torch.allclose(grad, derivative, atol=1e-5)


def _adapter_pairs(policy: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """A LoRA policy's reference-adapter parameters and the trained adapter's, in matching order."""
    params = dict(policy.named_parameters())
    names = [name for name in params if f".{REFERENCE_ADAPTER}." in name]
    return [params[n] for n in names], [params[n.replace(f".{REFERENCE_ADAPTER}.", ".default.")] for n in names]


def _position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, as ``generate`` does for left-padded prompts."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _md(text: str, limit: int = 300) -> str:
    return text[:limit].replace("|", "\\|").replace("\n", " ")


class _Timer:
    """Wall-clock seconds per named phase (synchronising CUDA so GPU work is counted)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
