"""The sampler: prompts in, a :class:`~rlhf_lightning.trajectory.Trajectory` out.

One object, built with the networks (``PPORLHF.configure_model``), whose inputs are explicit: the tokenizer,
the rollout engine, the :class:`~rlhf_lightning.networks.Networks` it samples and scores with (their LoRA
settings with them), the sampling, prompt, off-policy and runtime settings, the reward call and the seed base. It runs in two steps, so
that who draws and who assembles can differ:

1. ``draw``: the prompts encoded, the engine's responses at a declared seed (the engine's own copy of the
   weights synced first where it lags), kept as :class:`Drawn`: what the engine returned, nothing computed from
   the weights being trained. The synchronous loop draws in its own step; the asynchronous sampler
   (async_rollout.py) draws ahead on a published copy of older weights (``view``), and may ``score_drawn``
   there too (the reward, a frozen reference's log-probs).
2. ``trajectory``: the rows assembled (prompt, response, masks, EOS), pi_old and V_old from the trainer's
   networks, log pi_ref (or the sampler's; the response's ids after the teacher's prompt where
   ``model.prompts.teacher_template`` gives one: ``reference_inputs``), the starting policy's beside a moving or foreign reference, and the
   rollout correction's weights.

A new way of drawing plugs in at step 1: an episode with an environment (``model.environment``) is a ``draw``
that runs turn by turn (episodes.py: the engine's turn, the environment's ids appended as they are, the next turn),
its :class:`~rlhf_lightning.episodes.EpisodeLayout` in the ``Drawn``; a response that spans weight versions is a
``draw`` whose view changes between tokens (inflight.py, each token's version in ``Drawn.token_versions``). Each returns a ``Drawn`` whose ids are the ones drawn, so that
``trajectory`` scores exactly those.

The rollout engine sees the sampler (or a view of it) as its ``module``: ``networks``, ``sampling``,
``prompts``, ``off_policy``, ``runtime``, ``tokenizer``, ``device``, ``exploration``, ``global_step`` (the
optimizer steps of the weights it samples), ``global_rank``, ``local_rank`` and ``generation_seed_base``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from rlhf_lightning import checks, sampling
from rlhf_lightning import ppo_math as pm
from rlhf_lightning.args import OffPolicyArgs, PromptArgs, RuntimeArgs, SamplingArgs
from rlhf_lightning.callbacks import Timer
from rlhf_lightning.episodes import EpisodeDraw, EpisodeLayout, token_bound
from rlhf_lightning.interfaces import Environment, RolloutEngine, Samples
from rlhf_lightning.networks import Networks
from rlhf_lightning.trajectory import Trajectory

Reward = Callable[[list[str], list[str]], tuple[Optional[Tensor], Optional[str]]]


@dataclass
class Drawn:
    """One batch as the engine drew it (per-row tensors on the sampler's device), and what a sampler drawing ahead
    scored of it (``Sampler.score_drawn``; None: the trainer scores it when it is consumed)."""

    iteration: int  # the iteration that trains on it
    prompts: list[str]  # its rows' prompts (each repeated num_generations times)
    enc: dict[str, Tensor]  # the prompts' encoding (input_ids, attention_mask), left-padded
    samples: Samples  # the engine's output
    version: int  # the version of the weights that sampled it (PPO iterations done)
    seconds: float = 0.0  # the sampler's own time drawing it, when it drew ahead
    ref_logprobs: Optional[Tensor] = None  # log pi_ref of the sampled tokens, on the kept set (batch, response_len)
    ref_logits: Optional[Tensor] = None  # the reference's logits, only when the KL estimator needs them
    raw_scores: Optional[Tensor] = None  # r_RM as the backend returned it (None with a reward fault)
    reward_fault: Optional[str] = None  # why r_RM was not finite
    scoring_seconds: float = 0.0  # the sampler's time scoring it
    episode: Optional[EpisodeLayout] = None  # with an environment: which of the ids are the policy's, each token's turn
    token_versions: Optional[Tensor] = None  # (batch, response_len) long: each token's version, with in-flight updates (inflight.py)

    _TENSORS = ("ref_logprobs", "ref_logits", "raw_scores", "token_versions")

    def state_dict(self) -> dict[str, Any]:
        samples = {name: getattr(self.samples, name) for name in ("sequences", "logits", "logprobs", "hidden")}
        fields = dict(iteration=self.iteration, prompts=self.prompts, version=self.version, seconds=self.seconds)
        fields.update(reward_fault=self.reward_fault, scoring_seconds=self.scoring_seconds)
        fields.update({name: _cpu(getattr(self, name)) for name in self._TENSORS})
        fields.update(episode=None if self.episode is None else self.episode.state_dict())
        return {**fields, "enc": {k: v.cpu() for k, v in self.enc.items()}, "samples": {k: _cpu(v) for k, v in samples.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> Drawn:
        samples = Samples(**{k: None if v is None else v.to(device) for k, v in state["samples"].items()})
        enc = {k: v.to(device) for k, v in state["enc"].items()}
        scored = {name: None if state.get(name) is None else state[name].to(device) for name in cls._TENSORS}
        scored.update(reward_fault=state.get("reward_fault"), scoring_seconds=state.get("scoring_seconds", 0.0))
        episode = state.get("episode")
        scored.update(episode=None if episode is None else EpisodeLayout.from_state(episode, device))
        return cls(state["iteration"], list(state["prompts"]), enc, samples, state["version"], state["seconds"], **scored)


def _cpu(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.cpu()


class Sampler:
    """Draws responses to prompts with the rollout engine and assembles them into a ``Trajectory`` (module docstring).

    ``reward(prompts, responses) -> (raw_scores, fault)`` is the reward backend's checked call (the module's);
    ``needs_logits``: the KL estimator reads whole distributions (the trajectory keeps pi_old's and pi_ref's logits);
    ``reference_signal(ref_logits)``: what the trajectory keeps of pi_ref's (``KLEstimator.reference_signal``; None:
    the logits);
    ``teacher_prompts(prompts)``: the reference's prompt of each (a teacher that sees more, :meth:`reference_inputs`)."""

    def __init__(
        self,
        *,
        tokenizer,
        engine: RolloutEngine,
        networks: Networks,
        sampling: SamplingArgs,
        prompts: PromptArgs,
        off_policy: OffPolicyArgs,
        runtime: RuntimeArgs,
        reward: Reward,
        needs_logits: bool,
        seed_base: int,
        global_rank: int = 0,
        local_rank: int = 0,
        environment: Optional[Environment] = None,
        longest_prompt: Optional[int] = None,
        teacher_prompts: Optional[Callable[[list[str]], list[str]]] = None,
        reference_signal: Optional[Callable[[Tensor], Any]] = None,
    ) -> None:
        self.tokenizer, self.engine, self.networks = tokenizer, engine, networks
        self.sampling, self.prompts, self.off_policy, self.runtime = sampling, prompts, off_policy, runtime
        self.reward, self.needs_logits = reward, needs_logits
        self.generation_seed_base, self.global_rank, self.local_rank = seed_base, global_rank, local_rank
        self.global_step = 0  # the optimizer steps of the weights the engine samples (an engine with its own copy syncs when it changes)
        self.exploration = 0.0  # epsilon of the draw (model.sampling.explore)
        self.teacher_prompts = teacher_prompts  # each prompt's teacher prompt (model.prompts.teacher_template); None: the prompt
        self.reference_signal = reference_signal  # what the trajectory keeps of pi_ref's logits; None: them
        self.episodes = None
        if environment is not None:  # episodes: turn by turn, within the policy's context after the longest prompt
            bound = token_bound(environment, sampling, networks.policy.config, longest_prompt)
            self.episodes = EpisodeDraw(tokenizer, environment, sampling.max_new_tokens, bound)

    @property
    def device(self) -> torch.device:
        return next(self.networks.policy.parameters()).device

    def view(self, global_step: int, exploration: float = 0.0, networks: Optional[Networks] = None) -> Sampler:
        """This sampler on the weights of ``global_step`` optimizer steps (``networks``: another copy of them, the
        asynchronous sampler's), drawing with ``exploration``: what the engine is handed for one draw."""
        view = copy.copy(self)
        view.global_step, view.exploration = global_step, exploration
        view.networks = networks or self.networks
        return view

    def encode(self, prompts: list[str], field: str = "the prompts") -> dict[str, Tensor]:
        """The prompts encoded with the tokenizer and the prompt settings (``PromptArgs.encode``), on the sampler's device."""
        return {k: v.to(self.device) for k, v in self.prompts.encode(self.tokenizer, prompts, field).items()}

    def seed(self, iteration: int) -> int:
        """The seed iteration ``iteration``'s responses are drawn with, per (run, rank, iteration): ranks sample
        independently, and a resumed run or a sampler running ahead draws the same responses."""
        return self.generation_seed_base + 7919 * self.global_rank + 104729 * iteration

    # ------------------------------------------------------------------ 1. draw
    @torch.no_grad()
    def draw(
        self, prompts: list[str], iteration: int, version: int, timer: Optional[Timer] = None, enc: Optional[dict[str, Tensor]] = None
    ) -> Drawn:
        """The engine's responses to ``prompts`` (their encoding ``enc``, encoded here if None) at iteration
        ``iteration``'s seed, from this sampler's weights (``version``): the engine's own copy synced first where it
        lags (timed as ``weight_sync``), the draw timed as ``rollout``."""
        timer = timer or Timer(self.device)
        enc = self.encode(prompts) if enc is None else enc
        if self.engine.stale(self):
            with timer("weight_sync"):
                self.engine.sync(self)
        with timer("rollout"):
            if self.episodes is None:
                samples, episode = self.engine.checked_sample(self, enc, self.seed(iteration)), None
            else:
                samples, episode = self.episodes.draw(self, list(prompts), enc, self.seed(iteration))
        return Drawn(iteration, list(prompts), enc, samples, version, episode=episode)

    def score_drawn(self, drawn: Drawn, reference: bool) -> None:
        """What the trainer would compute from ``drawn`` alone, computed where it was drawn: the reward and, with
        ``reference`` (a frozen reference the sampler may run) and a kept set the sampler knows (its logits), log
        pi_ref, the same functions on the same tensors as ``trajectory``."""
        input_ids, attention_mask, response, _, _ = self.assemble(drawn.enc, drawn.samples, drawn.episode)
        texts = self.tokenizer.batch_decode(response, skip_special_tokens=True)
        drawn.raw_scores, drawn.reward_fault = self.reward(drawn.prompts, texts)
        if not reference or drawn.samples.logits is None:  # it moves, or the kept set is the trainer's
            return
        networks = self.networks
        kept = networks.kept(networks.tempered(drawn.samples.logits.float()), response)
        ref_logits = networks.reference_logits(*self.reference_inputs(drawn, input_ids, attention_mask, response), response.shape[1], kept)
        drawn.ref_logprobs = pm.logprobs_of(ref_logits, response)
        drawn.ref_logits = ref_logits if self.needs_logits else None

    # ------------------------------------------------------------------ 2. assemble
    def assemble(
        self, enc: dict[str, Tensor], samples: Samples, episode: Optional[EpisodeLayout] = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """A batch's rows from the prompts' encoding ``enc`` and the engine's ``samples``: ``(input_ids,
        attention_mask, response, response_mask, ended_with_eos)``, the response's padding after EOS pad tokens. An
        episode's (``episode``): the response mask is the policy's tokens (every episode token with the environment's
        ``policy_tokens_only: false``), the attention mask every episode token, ended: its last turn at EOS."""
        eos, device = self.tokenizer.eos_token_id, self.device
        response = samples.sequences[:, enc["input_ids"].shape[1] :].to(device)  # right-padded with pad
        if episode is None:
            mask = attend = pm.response_mask(response, eos)
            ended = ((response == eos) & mask.bool()).any(-1)
        else:
            attend, ended = episode.episode_mask, episode.ended_with_eos
            mask = episode.policy_mask if self.episodes.environment.policy_tokens_only else attend
        attention_mask = torch.cat([enc["attention_mask"], attend.to(enc["attention_mask"].dtype)], dim=1)
        # Padding after EOS becomes pad tokens, whatever the sampler wrote there.
        response = torch.where(attend.bool(), response, torch.full_like(response, self.tokenizer.pad_token_id))
        return torch.cat([enc["input_ids"], response], dim=1), attention_mask, response, mask, ended

    def reference_inputs(self, drawn: Drawn, input_ids: Tensor, attention_mask: Tensor, response: Tensor) -> tuple[Tensor, Tensor]:
        """What the reference reads of the rows ``input_ids``, ``attention_mask`` (``assemble``'s): those, or with
        ``teacher_prompts`` each row's teacher prompt (encoded as the student's: ``PromptArgs.encode``, left-padded)
        followed by the row's ``response`` ids as drawn, never re-tokenised, and their attention mask; the response
        keeps its positions at the end, so the reference's logits are read at the same (batch, response_len)."""
        if self.teacher_prompts is None:
            return input_ids, attention_mask
        teacher = self.encode(self.teacher_prompts(drawn.prompts), "model.prompts.teacher_template")
        ids = torch.cat([teacher["input_ids"], response], dim=1)
        return ids, torch.cat([teacher["attention_mask"], attention_mask[:, -response.shape[1] :]], dim=1)

    @torch.no_grad()
    def trajectory(self, drawn: Drawn, timer: Optional[Timer] = None, critic_values: bool = True, exploration: float = 0.0) -> Trajectory:
        """The ``Trajectory`` of ``drawn`` on the trainer's networks: pi_old and V_old (``Networks.old_policy``; a
        separate critic's only with ``critic_values``), log pi_ref (the sampler's where it scored the batch, else one
        batched forward of the reference on the sampler's kept set) and log pi_0 beside a moving or foreign reference,
        timed as ``forward``; ``exploration``: the epsilon ``drawn`` was drawn with."""
        timer = timer or Timer(self.device)
        networks, samples = self.networks, drawn.samples
        input_ids, attention_mask, response, mask, ended = self.assemble(drawn.enc, samples, drawn.episode)
        with timer("forward"):
            old = networks.old_policy(samples, input_ids, attention_mask, response, mask, critic_values, exploration)
            ref_logprobs, ref_logits = drawn.ref_logprobs, drawn.ref_logits
            if ref_logprobs is None:
                if self.teacher_prompts is None and networks.reference_is_policy():  # the same function on the same ids: a KL of 0
                    ref_logits = old.logits
                else:
                    ref_inputs = self.reference_inputs(drawn, input_ids, attention_mask, response)
                    ref_logits = networks.reference_logits(*ref_inputs, response.shape[1], old.kept)
                ref_logprobs = pm.logprobs_of(ref_logits, response)
            initial_logits = None
            if networks.initial_is_apart:  # the starting policy, for objective/kl_to_initial
                with networks.initial() as initial:
                    initial_logits = networks.kept_logits(initial, input_ids, attention_mask, response.shape[1], old.kept)
        keep_logits = self.needs_logits
        from_sampler = self.sampling.old_logprobs == "sampler" and not exploration
        return Trajectory(
            prompts=list(drawn.prompts),
            response_texts=self.tokenizer.batch_decode(response, skip_special_tokens=True),
            input_ids=input_ids,
            attention_mask=attention_mask,
            responses=response,
            response_mask=mask,
            ended_with_eos=ended,
            old_logprobs=old.sampler_logprobs if from_sampler else old.trainer_logprobs,
            trainer_logprobs=old.trainer_logprobs,
            sampler_logprobs=old.sampler_logprobs,
            ref_logprobs=ref_logprobs,
            old_values=None if old.values is None else old.values * mask,
            entropy=pm.entropy_of(old.logits),
            old_logits=old.logits if keep_logits else None,
            ref_logits=None if not keep_logits else self.reference_signal(ref_logits) if self.reference_signal else ref_logits,
            initial_logprobs=None if initial_logits is None else pm.logprobs_of(initial_logits, response),
            initial_logits=initial_logits if keep_logits else None,
            kept=old.kept,
            policy_version=torch.full((len(drawn.prompts),), drawn.version, dtype=torch.long, device=self.device),
            token_versions=drawn.token_versions,
            is_weights=sampling.correction_weights(
                old.trainer_logprobs, old.sampler_logprobs, mask, *self.off_policy.weights(self.sampling, exploration)
            ),
            raw_scores=drawn.raw_scores,
            reward_fault=drawn.reward_fault,
            episode=drawn.episode,
        )

    @torch.no_grad()
    def rollout(
        self,
        prompts: list[str],
        iteration: int,
        global_step: int,
        exploration: float = 0.0,
        timer: Optional[Timer] = None,
        critic_values: bool = True,
        drawn: Optional[Drawn] = None,
        first: bool = False,
    ) -> Trajectory:
        """``draw`` then ``trajectory``: ``prompts`` sampled now from the weights of ``global_step`` optimizer steps
        (version ``iteration``), or the batch ``drawn`` ahead by the asynchronous sampler. ``first``: the run's first
        training rollout, where a sampler that draws one token alone is said once (nothing would be learnt)."""
        timer = timer or Timer(self.device)
        if drawn is None:
            drawn = self.view(global_step, exploration).draw(prompts, iteration, iteration, timer)
        trajectory = self.trajectory(drawn, timer, critic_values, exploration)
        if first and (
            untrainable := checks.point_mass_warning(self.sampling, trajectory.old_logprobs, trajectory.kept, trajectory.response_mask)
        ):
            rank_zero_warn(untrainable)
        return trajectory
