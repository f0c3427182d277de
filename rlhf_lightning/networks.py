"""The networks PPO reads, as one part the LightningModule owns and calls by name
(``self.networks.reference()``): the policy, its critic, the reference and the starting policy, and
every pass over them the loop needs, and ``build_networks``, which builds them (loading, LoRA and FSDP2
sharding are models.py's); the Lightning hooks are the module's.

A reference whose weights equal the policy's (iteration 0, right after a sync) computes the policy's
very function: its forward is skipped and the KL is exactly 0 (``reference_is_policy``). Under LoRA
the reference is the same weights with the adapter disabled (no second copy in memory), or, when it
moves, a second frozen adapter. A foreign reference (``model.reference``: another model, a teacher) is a
separate frozen model under LoRA too, and the starting policy is then kept beside it for the drift
(``initial``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor, nn

from rlhf_lightning import checks, fsdp2, models, prefix, sampling
from rlhf_lightning import ppo_math as pm
from rlhf_lightning.args import LoraArgs, OptimArgs, PromptArgs, SamplingArgs
from rlhf_lightning.interfaces import Samples
from rlhf_lightning.models import (
    REFERENCE_ADAPTER,
    ValueModel,
    adapter_pairs,
    add_lora,
    float32_head,
    frozen_copy,
    local_tensor,
    merged_adapter,
    move_toward,
    shard_models,
)
from rlhf_lightning.prefix import position_ids, trim_left_padding

Reduce = Callable[..., Tensor]  # a tensor summed (or maxed, op="max") over all ranks


class OldPolicy(NamedTuple):
    """pi_old of a rollout (``Networks.old_policy``); per-token tensors (batch, response_len)."""

    logits: Tensor  # (batch, response_len, vocab): tempered, restricted to the kept set
    values: Optional[Tensor]  # V_old(s_t); None without a critic
    kept: Optional[Tensor]  # (batch, response_len, vocab) bool: the sampler's kept set; None: every token
    trainer_logprobs: Tensor  # log pi_old of the sampled tokens, from ``logits``
    sampler_logprobs: Tensor  # the rollout engine's own (equal to trainer_logprobs when ``hf`` logits are used)


class Networks:
    """The policy, its critic (None without one), the reference (None when it is the LoRA policy
    with its adapter disabled or a reference adapter) and the starting policy beside a moving or
    foreign reference under full fine-tuning (None otherwise), with the passes over them.

    Its inputs are explicit: the sampling settings (temperature, the kept set), ``shared_prompts``,
    the LoRA settings, whether the reference moves, whether it is another model than the starting
    policy (``foreign_reference``), the EOS token, and ``reduce`` over the ranks
    (the strategy's: FSDP2's ranks agree on the passes they run). The module registers the models
    itself (Lightning's checkpoints, devices and strategies see them there); this part holds them to
    run them."""

    def __init__(
        self,
        policy: nn.Module,
        critic: Optional[ValueModel],
        ref_model: Optional[nn.Module],
        initial_model: Optional[nn.Module],
        *,
        sampling: SamplingArgs,
        shared_prompts: bool,
        lora: LoraArgs,
        reference_moves: bool,
        foreign_reference: bool,
        eos_token_id: int,
        reduce: Reduce,
    ) -> None:
        self.policy, self.critic, self.ref_model, self.initial_model = policy, critic, ref_model, initial_model
        self.sampling, self.shared_prompts, self.lora = sampling, shared_prompts, lora
        self.reference_moves, self.eos_token_id, self.reduce = reference_moves, eos_token_id, reduce
        self.foreign_reference = foreign_reference
        self.skeleton: Optional[nn.Module] = None  # FSDP2: the policy's structure on the meta device, kept before sharding

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank."""
        device = next(self.policy.parameters()).device
        return bool(self.reduce(torch.tensor(float(flag), device=device)) > 0)

    def nonfinite_weights(self, trained_only: bool = False) -> str:
        """The weights holding inf or nan, as ``policy model.layers.0.mlp.up_proj.weight`` (the first three and how many),
        '' where every one is finite on every rank: the policy's, the critic's and a foreign reference's (``trained_only``:
        those the optimizer steps). One ``isfinite`` per tensor and one synchronisation, so it runs before every draw."""
        models = {"policy": self.policy, "critic": self.critic, "model.reference": self.ref_model if self.foreign_reference else None}
        named = [
            (f"{role} {name}", local_tensor(p))
            for role, model in models.items()
            if model is not None
            for name, p in model.named_parameters()
            if p.requires_grad or not trained_only
        ]
        flags = torch.stack([torch.isfinite(t.detach()).all() for _, t in named]).cpu()
        bad = [name for (name, _), ok in zip(named, flags.tolist(), strict=True) if not ok]
        if not self.any_rank(bool(bad)):
            return ""
        listed = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return f"{listed} ({len(bad)} of {len(named)} tensors)" if bad else "another rank's shards"

    # ------------------------------------------------------------------ forward passes
    def response_logits(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_len: int, return_hidden: bool = False):
        """Temperature-scaled float32 logits predicting each response token: (batch, response_len, vocab);
        with ``return_hidden`` also the last layer's hidden states at those positions (batch,
        response_len, hidden), read from the output layer's input (no other layer's are kept). Rows
        that share a prompt share its forward pass (``shared_prompts``: rlhf_lightning/prefix.py)."""
        input_ids, attention_mask = trim_left_padding(input_ids, attention_mask)
        shared, common, beginning = self.shared_prompt_tokens(input_ids, attention_mask, response_len)
        hidden = [] if return_hidden else None
        with float32_head(model, hidden):
            if shared:
                logits = prefix.shared_prompt_logits(
                    model, input_ids, attention_mask, response_len, *shared, hidden=hidden, beginning=beginning
                )
            elif common:
                logits = prefix.on_common_prefix(model, input_ids, attention_mask, common, logits_to_keep=response_len + 1).logits[:, :-1]
                hidden = hidden[-1:] if return_hidden else None  # not the prefix pass's
            else:
                logits = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids(attention_mask),
                    use_cache=False,
                    logits_to_keep=response_len + 1,
                ).logits[:, :-1]
        logits = self.tempered(logits)
        if return_hidden:
            return logits, hidden[0] if shared else hidden[0][:, :-1]
        return logits

    def tempered(self, logits: Tensor) -> Tensor:
        """``logits / temperature``, without a copy of the full-vocabulary tensor at temperature 1."""
        return logits if self.sampling.temperature == 1 else logits / self.sampling.temperature

    def policy_outputs(
        self, input_ids: Tensor, attention_mask: Tensor, response_len: int, critic: bool = True
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Policy logits and critic values V(s_t) before each response token, (batch, response_len);
        values are None without a critic or when not ``critic`` (the caller runs a separate critic apart)."""
        if self.critic is None or not critic:
            return self.response_logits(self.policy, input_ids, attention_mask, response_len), None
        if self.shared_critic:  # one forward pass gives both
            logits, hidden = self.response_logits(self.policy, input_ids, attention_mask, response_len, True)
            return logits, self.critic(hidden=hidden)
        logits = self.response_logits(self.policy, input_ids, attention_mask, response_len)
        return logits, self.critic_values(input_ids, attention_mask, response_len)

    def critic_values(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> Tensor:
        """A separate critic's V(s_t) before each response token, (batch, response_len); the first tokens
        all prompts share run once (``shared_prompt_tokens``; repeated prompts: whole rows)."""
        input_ids, attention_mask = trim_left_padding(input_ids, attention_mask)
        _, common, _ = self.shared_prompt_tokens(input_ids, attention_mask, response_len)
        if common:
            hidden = prefix.on_common_prefix(self.critic.trunk, input_ids, attention_mask, common, causal_lm=False).last_hidden_state
            return self.critic(hidden=hidden[:, -response_len - 1 : -1])
        values = self.critic(input_ids, attention_mask, position_ids(attention_mask))
        return values[:, -response_len - 1 : -1]

    def shared_prompt_tokens(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> tuple[Any, int, Optional[int]]:
        """With ``shared_prompts``, ``(shared, common, beginning)``: the rows' distinct prompts
        (``prefix.distinct_prompts``) where some repeat, else how many first tokens all prompts share
        (``prefix.common_prefix``: a chat template's system prompt), and how many the distinct prompts'
        pass runs once (None: all they share); (None, 0, None) without.

        Under FSDP2 every forward gathers the weights by collectives, so every rank must run the same passes
        whatever its prompts: the ranks agree, taking the distinct prompts only where every rank has repeats
        and the shortest beginnings. With autograd on there is no beginning pass: FSDP2's backward gathers a
        block's weights again when gradients reach that block's outputs, and a beginning pass's outputs reach
        the loss only through the keys and values it leaves in the cache (its blocks' backward then finds
        their weights freed)."""
        if not self.shared_prompts:
            return None, 0, None
        prompt_len = input_ids.shape[1] - response_len
        shared = prefix.distinct_prompts(input_ids, attention_mask, prompt_len)
        if not self.sharded:
            return shared, 0 if shared else prefix.common_prefix(input_ids, attention_mask, prompt_len), None
        common, beginning = 0, 0
        if not torch.is_grad_enabled():
            common = prefix.common_prefix(input_ids, attention_mask, prompt_len)
            beginning = prefix.prompts_beginning(input_ids, attention_mask, response_len, shared[0]) if shared else 0
        mine = torch.tensor([shared is not None, common, beginning])
        every, common, beginning = (int(v) for v in -self.reduce(-mine.double(), op="max"))  # the least on any rank
        return (shared, 0, beginning) if every else (None, common, None)

    def old_policy(
        self,
        samples: Samples,
        input_ids: Tensor,
        attention_mask: Tensor,
        response: Tensor,
        mask: Tensor,
        critic_values: bool = True,
        explore: float = 0.0,
    ) -> OldPolicy:
        """pi_old at sampling time on the declared distribution (``sampling``: tempered, restricted to
        the sampler's kept set): the trainer's logits, from the sampler's (``hf``) or from one batched
        forward (another engine, ``old_logprobs: forward`` or a rollout correction), V_old (a separate
        critic's only with ``critic_values``), the kept set, and the sampler's own log-probs of the
        sampled tokens (the trainer's past EOS): with ``explore`` epsilon > 0 the exploring mixture's
        (``sampling.explored``), which the engine drew from."""
        sampled, response_len = self.sampling, response.shape[1]
        sampler_logits = None if samples.logits is None else self.tempered(samples.logits.float())
        if sampler_logits is None or sampled.old_logprobs == "forward" or sampled.rollout_correction != "none":
            logits, values = self.policy_outputs(input_ids, attention_mask, response_len, critic=critic_values or self.shared_critic)
        elif self.shared_critic:
            logits, values = sampler_logits, self.critic(hidden=samples.hidden)
        else:
            separate = self.critic is not None and critic_values
            logits, values = sampler_logits, self.critic_values(input_ids, attention_mask, response_len) if separate else None
        kept = self.kept(logits if sampler_logits is None else sampler_logits, response)
        logits = sampling.restrict(logits, kept)
        trainer_logprobs = pm.logprobs_of(logits, response)
        if sampler_logits is logits and not explore:  # the sampler's logits are the trainer's (``hf``)
            sampler_logprobs = trainer_logprobs
        elif sampler_logits is not None:
            sampler_logprobs = pm.logprobs_of(sampling.explored(sampling.restrict(sampler_logits, kept), explore), response)
        else:
            sampler_logprobs = torch.where(mask.bool(), samples.logprobs.to(logits.device), trainer_logprobs)
        return OldPolicy(logits, values, kept, trainer_logprobs, sampler_logprobs)

    def kept(self, logits: Tensor, response: Tensor) -> Optional[Tensor]:
        """The sampler's kept set of each response position (``sampling.kept_tokens``: top-k, top-p and the
        ``min_new_tokens`` ban) from the tempered ``logits`` it sampled with, every sampled token in it; None: every token."""
        sampled = self.sampling
        banned = sampling.min_new_tokens_ban(logits.shape, self.eos_token_id, sampled.min_new_tokens, logits.device)
        top_k, top_p = (sampled.top_k, sampled.top_p) if sampled.do_sample else (0, 1.0)
        kept = sampling.kept_tokens(logits, top_k, top_p, banned)
        if kept is not None:  # the sampled token was kept, whatever rounding at a top-p boundary says (another engine's kernels)
            kept = kept.scatter(-1, response.unsqueeze(-1), True)
        return kept

    def kept_logits(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_len: int, kept: Optional[Tensor]) -> Tensor:
        """``model``'s logits predicting each response token (``response_logits``), on the kept set (batch, response_len, vocab)."""
        return sampling.restrict(self.response_logits(model, input_ids, attention_mask, response_len), kept)

    def reference_logits(self, input_ids: Tensor, attention_mask: Tensor, response_len: int, kept: Optional[Tensor]) -> Tensor:
        """The reference's logits predicting each response token, on the kept set (batch, response_len, vocab)."""
        with self.reference() as ref:
            return self.kept_logits(ref, input_ids, attention_mask, response_len, kept)

    # ------------------------------------------------------------------ the sampler and the reference
    @contextlib.contextmanager
    def generator(self):
        """The model that samples. LoRA: the PeftModel's base model, which carries the injected
        LoRA layers (PeftModel.generate adds its own overhead per decode step), with the adapter merged into
        the base weights while it samples when ``lora.merge_for_generation`` (no LoRA branch in
        each of the hundreds of decode-step linears; unmerging restores fp32 weights to within
        one rounding step). FSDP2: the policy's full weights are gathered once for the whole
        rollout (``fsdp2.gathered``; a merge then writes into the gathered copy only, and the
        shards stay bit-exact), instead of every block being all-gathered again at each of the
        ``max_new_tokens`` decode steps by FSDP2's forward hooks."""
        with contextlib.ExitStack() as stack:
            if self.sharded:
                stack.enter_context(fsdp2.gathered(fsdp2.fsdp_roots(self.policy)[0]))
            if not self.lora.rank:
                yield self.policy
                return
            if self.lora.merge_for_generation:
                stack.enter_context(merged_adapter(self.policy))
            yield self.policy.get_base_model()

    @contextlib.contextmanager
    def reference(self):
        """The reference: a separate copy, or the LoRA policy with its adapter disabled (frozen
        reference) or with the reference adapter active instead of the policy's (moving reference)."""
        if self.ref_model is not None:
            yield self.ref_model
        elif self.reference_moves:
            self.policy.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
            try:
                yield self.policy
            finally:
                self.policy.set_adapter("default")  # trainable again; the reference adapter stays frozen
        else:
            with self.policy.disable_adapter():
                yield self.policy

    @property
    def initial_is_apart(self) -> bool:
        """Whether the starting policy pi_0 is not the reference (a moving or a foreign one): its own pass
        gives the drift, ``objective/kl_to_initial``."""
        return self.reference_moves or self.foreign_reference

    @contextlib.contextmanager
    def initial(self):
        """The starting policy pi_0 beside a moving or foreign reference: its frozen copy, or the adapter-disabled LoRA policy."""
        if self.initial_model is not None:
            yield self.initial_model
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def reference_is_policy(self) -> bool:
        """Whether the reference computes the policy's very function, its weights equal bit for bit:
        a full copy before the first optimizer step or right after a sync; under LoRA the reference
        adapter equal to the policy's, or the adapter-disabled reference while the policy's adapter
        is still the identity (every lora_B zero: x + 0 = x exactly). Its log-probs are then the
        policy's own (from the sampler or a forward), so the KL is exactly 0 and no reference
        forward runs; compared smallest tensors first, so a trained policy differs within a few. A foreign
        reference is another model: never (its forward always runs)."""
        if self.foreign_reference:
            return False
        if self.ref_model is not None or self.reference_moves:
            pairs = list(zip(*self.reference_parameters(), strict=True))
        else:
            pairs = [(p, torch.zeros_like(p)) for name, p in self.policy.named_parameters() if ".lora_B.default." in name]
        same = all(torch.equal(local_tensor(a), local_tensor(b)) for a, b in sorted(pairs, key=lambda pair: pair[0].numel()))
        return not self.any_rank(not same)

    def move_reference(self, alpha: float) -> None:
        """ref <- (1 - alpha) ref + alpha policy, on every rank the same update of the same weights
        (under FSDP2 each rank moves its own shards, not a root's copy still gathered from a forward)."""
        if self.sharded:
            fsdp2.reshard(self.policy, self.ref_model)
        move_toward(*self.reference_parameters(), alpha)

    def reference_parameters(self) -> tuple[list[Tensor], list[Tensor]]:
        """The moving reference's parameters and the policy's they move toward, in matching order."""
        if self.ref_model is not None:
            return list(self.ref_model.parameters()), list(self.policy.parameters())
        return adapter_pairs(self.policy)

    @property
    def shared_critic(self) -> bool:
        """A value head on the policy's own hidden states (no trunk of its own)."""
        return self.critic is not None and self.critic.trunk is None

    @property
    def sharded(self) -> bool:
        """The models are FSDP2-sharded (ModelParallelStrategy)."""
        return fsdp2.is_sharded(self.policy)

    # ------------------------------------------------------------------ the optimizer
    def optimizer(self, optim: OptimArgs, fused: bool) -> torch.optim.AdamW:
        """One AdamW over the parameter groups ``policy`` (lr) and ``critic`` (critic_lr), each with its own weight
        decay: AdamW's update is per parameter, so this is the update of one AdamW per model (tests/test_gpu.py),
        and it is what DeepSpeed supports (one optimizer); one optimizer step, one GradScaler update under
        16-mixed. ``fused``: one kernel per step instead of a dozen per tensor (not under mixed precision: the
        module's ``configure_optimizers``)."""
        groups = [{"name": "policy", "params": [p for p in self.policy.parameters() if p.requires_grad], "lr": optim.lr}]
        if self.critic is not None:
            groups.append({"name": "critic", "params": list(self.critic.parameters()), "lr": optim.critic_lr or optim.lr})
        return torch.optim.AdamW(groups, weight_decay=optim.weight_decay, fused=fused)

    @staticmethod
    def clip_gradients(optimizer: torch.optim.Optimizer, optim: OptimArgs) -> None:
        """Clip the gradients to ``optim.max_grad_norm`` (0: not at all): each parameter group's norm on its own
        (``optimizers: separate``) or the norm of all (``shared``)."""
        if not optim.max_grad_norm:
            return
        groups = [group["params"] for group in optimizer.param_groups]
        for params in groups if optim.optimizers == "separate" else [[p for group in groups for p in group]]:
            torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm)

    # ------------------------------------------------------------------ the critic's passes in the update
    def critic_apart(self, ddp: bool) -> bool:
        """A separate critic's value loss is a forward and backward pass of its own, after the policy's
        (the graphs share no tensor: the gradients are those of the sum): FSDP2 frees a root unit's
        gathered weights and full gradient only when a backward pass ends, so neither model's root
        nor activations are then held through the other's backward. Not under DDP (``ddp``), whose reducer
        expects every parameter's gradient in each pass."""
        return self.critic is not None and not self.shared_critic and not ddp

    @staticmethod
    def old_values_in_update(critic_apart: bool, num_minibatches: int, gradient_accumulation_steps: int) -> bool:
        """Whether a separate critic's V_old comes from the update's first forward of it instead of a forward of
        its own while scoring: when that first minibatch is the whole batch in one micro-batch (one minibatch, no
        accumulation), where the critic still has V_old's weights. One critic trunk forward per iteration fewer,
        the same values (tests/test_module.py)."""
        return critic_apart and num_minibatches == 1 and gradient_accumulation_steps == 1

    def first_critic_values(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
        """The separate critic's forward of the whole batch (the update's first minibatch), its graph kept for that
        minibatch's value loss, and V_old: its detached values on the response mask."""
        values = self.critic_values(input_ids, attention_mask, response_mask.shape[1])
        return values, values.detach() * response_mask


def build_networks(
    load_policy: Callable[[bool], tuple[nn.Module, Any]],
    load_reference: Optional[Callable[[bool], tuple[nn.Module, Any]]],
    *,
    critic: str,
    sampling: SamplingArgs,
    prompts: PromptArgs,
    lora: LoraArgs,
    reference_moves: bool,
    shared_prompts: bool,
    eos_token_id: int,
    reduce: Reduce,
    device_mesh=None,
    longest_prompt: Optional[int] = None,
    keep_skeleton: bool = False,
) -> Networks:
    """The networks as configured: the policy from ``load_policy(empty)`` (with LoRA where ``lora.rank`` > 0), its
    critic (``critic``: separate, shared or none), the reference (the starting policy's frozen copy, the LoRA
    policy with its adapter disabled, or the foreign model of ``load_reference(empty)``) and the starting policy
    beside a moving or foreign reference, each checked against the prompts' context (``longest_prompt`` tokens).
    Under FSDP2 (``device_mesh``) no rank holds a full copy: the critic's trunk and the reference are skeletons on the
    meta device, and so is the policy when its checkpoint is a safetensors folder; once sharded, each rank reads its
    own rows of every tensor (``fsdp2.materialise``). A policy built whole (the tiny model, a GGUF file) is the one
    full copy, freed once its shards are taken. ``keep_skeleton``: keep the policy's structure before sharding
    (``Networks.skeleton``), for the asynchronous sampler's whole copy."""
    sharded = device_mesh is not None
    copy_of = fsdp2.meta_copy if sharded else copy.deepcopy
    policy, rows = load_policy(sharded)
    checks.check_context(prompts, sampling, policy.config, longest_prompt)
    value_model = None if critic == "none" else ValueModel.from_policy(policy, shared=critic == "shared", copy_of=copy_of)
    foreign = load_reference is not None
    trained, ref_model, initial_model = policy, None, None
    if lora.rank > 0:
        trained = add_lora(policy, lora, reference_moves)
    else:
        ref_model = None if foreign else frozen_copy(policy, copy_of)
        initial_model = frozen_copy(policy, copy_of) if reference_moves or foreign else None
    reference_rows = None
    if foreign:  # a separate frozen model, under LoRA too (the adapter-disabled policy is then pi_0)
        reference, reference_rows = load_reference(sharded)
        checks.check_context(prompts, sampling, reference.config, longest_prompt, "model.reference's")
        models.check_reference_vocabulary(policy, reference)
        ref_model = frozen_copy(reference, copy_of=lambda model: model)
    skeleton = fsdp2.meta_copy(trained) if sharded and keep_skeleton else None
    if sharded:
        shard_models(device_mesh, trained, value_model, ref_model, initial_model, rows, lora.rank > 0, reference_rows)
    networks = Networks(
        trained,
        value_model,
        ref_model,
        initial_model,
        sampling=sampling,
        shared_prompts=shared_prompts,
        lora=lora,
        reference_moves=reference_moves,
        foreign_reference=foreign,
        eos_token_id=eos_token_id,
        reduce=reduce,
    )
    networks.skeleton = skeleton
    bad = networks.nonfinite_weights()
    checks.require(
        not bad,
        "model.policy and model.reference",
        "checkpoints of finite weights (a nan or inf weight makes every log-prob the sampler draws with nan)",
        f"non-finite weights in {bad}",
    )
    return networks
