"""Two-turn episodes the unchanged loop trains on: a chance environment, a task whose reward reads the transcript, and
the exact J, J* and tilt of the tiny network's policy (:mod:`~rlhf_lightning.exact.episodes` is the math).

An episode of :class:`ExactEpisodeTask`: the prompt x, the policy's first turn y1 (``response_length`` content tokens),
the environment's observation o, one of the K content tokens drawn from P(o|x, y1) by :class:`LabChance` (registered
as ``lab_chance`` when this file is imported: the framework never imports the lab), the policy's second turn y2
(``response_length`` tokens), then the reward r(x, y1, o, y2), which the ``callable`` backend reads off the transcript
text y1 o y2 (:func:`episode_reward`). Turns have a fixed length (no EOS), so the transcript splits by position.

The observation is written with the content tokens' own ids: the network then has a proper distribution over the
observations at that position, pi_theta(o|x, y1), which is what the loop charges when the environment's token is
counted as the policy's (``policy_tokens_only: false``), the known mistake the lab measures
(:func:`~rlhf_lightning.exact.episodes.environment_tokens_counted`, with the reference network's own pi_ref(o|x, y1)).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.checks import require
from rlhf_lightning.exact.episodes import (
    environment_tokens_counted,
    episode_objective,
    episode_tilt,
    kl_to_optimum,
    random_episode_task,
    soft_bellman,
)
from rlhf_lightning.exact.tabular import expected_log_ratio
from rlhf_lightning.exact.tasks import ExactPPORLHF, ExactTask, toy_tokenizer
from rlhf_lightning.interfaces import Environment, Step
from rlhf_lightning.registry import register


def episode_reward(prompts: Sequence[str], responses: Sequence[str], tables: dict[str, dict[str, float]]) -> list[float]:
    """Reward for the ``callable`` backend: r(x, y1, o, y2) = ``tables[x][y1 o y2]``, the episode's transcript text."""
    return [float(tables[prompt.strip()][response]) for prompt, response in zip(prompts, responses, strict=True)]


@register("environment", "lab_chance", description="the lab's chance node: after the first turn o ~ P(o|x, y1), done after the second")
class LabChance(Environment):
    """After the policy's first turn, an observation o drawn from P(o|x, y1) (``observations[x][y1]``, probabilities
    over the O observations) with a generator seeded from ``reset``'s seed (a redrawn episode is the same), answered
    as the single id ``observation_ids[o]``; the episode ends after the second turn (``done``). ``max_turns`` 2."""

    def __init__(self, observations: dict[str, dict[str, list[float]]], observation_ids: list[int], **limits: Any) -> None:
        super().__init__(**{"max_turns": 2, **limits})
        require(
            all(len(p) == len(observation_ids) for rows in observations.values() for p in rows.values()),
            "lab_chance's observations",
            f"one probability per observation id ({len(observation_ids)})",
            observation_ids,
        )
        self.observations, self.observation_ids = observations, list(observation_ids)

    def reset(self, prompt: str, seed: int) -> dict[str, Any]:
        return {"prompt": prompt.strip(), "generator": torch.Generator().manual_seed(seed), "turn": 0}

    def step(self, state: dict[str, Any], turn_text: str, turn_ids: Sequence[int]) -> Step:
        state["turn"] += 1
        if state["turn"] > 1:
            return Step(done=True)
        probs = torch.tensor(self.observations[state["prompt"]][turn_text], dtype=torch.float64)
        state["observation"] = int(torch.multinomial(probs, 1, generator=state["generator"]))
        return Step(observation_ids=[self.observation_ids[state["observation"]]])


@dataclass(frozen=True)
class ExactEpisodeTask(ExactTask):
    """An :class:`ExactTask` whose responses are two-turn episodes: ``observations[x][y1]`` is P(o|x, y1) over the K
    content tokens (the environment's answers), ``reward_kwargs["tables"][x][y1 o y2]`` the reward (:func:`episode_reward`).
    Fixed-length turns only (``eos`` False)."""

    reward_function: str = "rlhf_lightning.exact.episode_tasks:episode_reward"
    observations: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            not self.eos and self.teacher_seed is None, "an episode task", "fixed-length turns, no teacher", (self.eos, self.teacher_seed)
        )

    @classmethod
    def random(
        cls, seed: int, num_prompts: int = 2, num_tokens: int = 2, length: int = 2, reward_scale: float = 2.0, spread: float = 1.0
    ) -> ExactEpisodeTask:
        """A seeded task with the rewards and P of :func:`~rlhf_lightning.exact.episodes.random_episode_task` (its O the K
        content tokens, its stakes: gambles and safe first turns), the tiny network initialised from ``seed`` as pi_ref
        (with a position embedding, as :meth:`ExactTask.random`), each prompt's reward centred under it (J(pi_ref) = 0)."""
        tensors = random_episode_task(seed, num_prompts, num_tokens, length, length, num_tokens, reward_scale=reward_scale, spread=spread)
        prompts = tuple(chr(ord("A") + i) for i in range(num_prompts))
        tokens = tuple(chr(ord("a") + i) for i in range(num_tokens))
        turns = ["".join(t) for t in itertools.product(tokens, repeat=length)]
        observations = {x: {y1: tensors.obs_probs[i, j].tolist() for j, y1 in enumerate(turns)} for i, x in enumerate(prompts)}
        task = cls(
            prompts=prompts,
            content_tokens=tokens,
            response_length=length,
            reward_kwargs={"tables": {}},
            model_seed=seed,
            position_embedding=True,
            observations=observations,
        )
        rewards = tensors.rewards
        ref1, _, ref2 = episode_reference(task)
        reference = ref1.exp()[..., None, None] * tensors.obs_probs[..., None] * ref2.exp()
        rewards = rewards - (reference * rewards).sum((1, 2, 3), keepdim=True)
        tables = {x: {t: float(rewards.flatten(1)[i, k]) for k, t in enumerate(task.transcripts)} for i, x in enumerate(prompts)}
        return dataclasses.replace(task, reward_kwargs={"tables": tables})

    @property
    def turns(self) -> list[str]:
        """Every turn's text, in the order of :func:`~rlhf_lightning.exact.tabular.enumerate_responses`."""
        return ["".join(t) for t in itertools.product(self.content_tokens, repeat=self.response_length)]

    @property
    def transcripts(self) -> list[str]:
        """y1 o y2 for every (y1, o, y2), y1 slowest: the rewards' last three dimensions flattened."""
        return [y1 + o + y2 for y1 in self.turns for o in self.content_tokens for y2 in self.turns]

    def obs_probs(self) -> Tensor:
        """P(o|x, y1): (X, N1, O) float64."""
        return torch.tensor([[self.observations[x][y1] for y1 in self.turns] for x in self.prompts], dtype=torch.float64)

    def rewards(self) -> Tensor:
        """r(x, y1, o, y2) from the reward backend itself: (X, N1, O, N2) float64."""
        backend, transcripts, n = self.reward_model(), self.transcripts, len(self.turns)
        scores = [backend.score([x] * len(transcripts), transcripts) for x in self.prompts]
        return torch.tensor(scores, dtype=torch.float64).view(len(self.prompts), n, len(self.content_tokens), n)

    def environment(self, observation_ids: Sequence[int], policy_tokens_only: bool = True) -> LabChance:
        """The task's :class:`LabChance`, the observations written with ``observation_ids`` (the content tokens' ids)."""
        return LabChance(self.observations, list(observation_ids), policy_tokens_only=policy_tokens_only)


@torch.no_grad()
def exact_episode_logprobs(module: ExactPPORLHF, model: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
    """``model``'s log-probs of every episode of ``module.task``, from one forward pass over every transcript x y1 o y2,
    scored as PPO scores rollouts (the declared distribution at each position): log pi(y1|x) (X, N1), log pi(o|x, y1)
    (X, N1, O), the network's own model of the environment, and log pi(y2|x, y1, o) (X, N1, O, N2); float64."""
    task: ExactEpisodeTask = module.task
    require(
        not module.truncates, "an episode task's sampling", "no top_k / top_p (the declared distribution is the network's)", module.sampling
    )
    length, n, observations = task.response_length, len(task.turns), len(task.content_tokens)
    symbols = torch.tensor(module.symbol_ids)
    turns = symbols[torch.tensor([[task.content_tokens.index(c) for c in t] for t in task.turns])]  # (N, L) ids
    response = torch.cat(
        [
            turns.repeat_interleave(observations * n, 0),
            symbols.repeat_interleave(n).repeat(n).unsqueeze(-1),
            turns.repeat(n * observations, 1),
        ],
        dim=1,
    ).to(module.device)  # (N1 * O * N2, 2L + 1), y1 slowest
    enc = module.sampler.encode(list(task.prompts))
    rows = response.shape[0]
    input_ids = torch.cat([enc["input_ids"].repeat_interleave(rows, 0), response.repeat(len(task.prompts), 1)], dim=1)
    attention_mask = torch.cat(
        [enc["attention_mask"].repeat_interleave(rows, 0), torch.ones_like(response).repeat(len(task.prompts), 1)], 1
    )
    logits = module.networks.response_logits(model, input_ids, attention_mask, 2 * length + 1)
    logprobs = pm.logprobs_of(logits, input_ids[:, -(2 * length + 1) :]).double().cpu()
    shape = (len(task.prompts), n, observations, n)
    first = logprobs[:, :length].sum(-1).view(shape)[:, :, 0, 0]
    observed = logprobs[:, length].view(shape)[..., 0]
    second = logprobs[:, length + 1 :].sum(-1).view(shape)
    return first, observed, second


def episode_reference(task: ExactEpisodeTask) -> tuple[Tensor, Tensor, Tensor]:
    """log pi_ref of ``task``'s episodes (:func:`exact_episode_logprobs`), the tiny model initialised from ``task.model_seed``."""
    module = ExactPPORLHF(task, seed=task.model_seed)
    module.configure_model()
    with module.networks.reference() as ref:
        return exact_episode_logprobs(module, ref)


class ExactEpisodePPORLHF(ExactPPORLHF):
    """:class:`ExactPPORLHF` on an :class:`ExactEpisodeTask`: the same tiny network and loop, with the task's
    :class:`LabChance` as ``model.environment`` (``policy_tokens_only`` passed to it: false is the mistake measured)."""

    def __init__(self, task: ExactEpisodeTask, policy_tokens_only: bool = True, **kwargs: Any) -> None:
        require("environment" not in kwargs, "ExactEpisodePPORLHF's arguments", "free of environment (the task's)", sorted(kwargs))
        ids = toy_tokenizer(task.prompts, task.content_tokens).convert_tokens_to_ids(list(task.content_tokens))
        super().__init__(task, **kwargs, environment=task.environment(ids, policy_tokens_only))

    def exact_episode(self) -> tuple[Tensor, Tensor, Tensor]:
        """The policy's (log pi1, log pi(o|x, y1), log pi2) of every episode (:func:`exact_episode_logprobs`)."""
        return exact_episode_logprobs(self, self.policy)

    def exact_episode_ref(self) -> tuple[Tensor, Tensor, Tensor]:
        """The reference's, the same way."""
        with self.networks.reference() as ref:
            return exact_episode_logprobs(self, ref)


@dataclass
class EpisodeRow:
    """Where a policy stands on an episode task (:func:`episode_report`)."""

    objective: float  # J(pi) under the real environment, the KL over the policy's tokens only
    optimum: float  # J*, the soft-Bellman optimum
    gap: float  # (J* - J) / |J*|
    kl_to_optimum: float  # E [KL(pi1 || pi1*) + E_P KL(pi2 || pi2*)]
    tilt_value: float  # beta E_x log Z of the episode tilt (its own objective, >= J*)
    tilt_objective: float  # J of the tilt's policy under the real environment
    counted_objective: float  # J where the environment's token is counted (k1 in the reward's fixed point)
    distance_to_tilt: float  # E KL(pi1 || pi1_tilt): 0 where a run took the tilt as its target
    distance_to_counted: float  # E KL(pi1 || pi1_counted)


def episode_report(
    pi1: Tensor, pi2: Tensor, ref1: Tensor, ref_obs: Tensor, ref2: Tensor, obs_probs: Tensor, rewards: Tensor, beta: float
) -> EpisodeRow:
    """The exact row of a policy (log pi1 (X, N1), log pi2 (X, N1, O, N2)) against the episode's optimum, the episode
    tilt and where counting the environment's token settles (``ref_obs``: the reference's model of o)."""
    optimum = soft_bellman(ref1, obs_probs, ref2, rewards, beta)
    tilt = episode_tilt(ref1, obs_probs, ref2, rewards, beta)
    counted = environment_tokens_counted(ref1, obs_probs, ref_obs, ref2, rewards, beta)
    j = float(episode_objective(pi1, pi2, ref1, obs_probs, ref2, rewards, beta))
    return EpisodeRow(
        objective=j,
        optimum=optimum.optimum,
        gap=(optimum.optimum - j) / abs(optimum.optimum),
        kl_to_optimum=float(kl_to_optimum(pi1, pi2, optimum, obs_probs)),
        tilt_value=tilt.value,
        tilt_objective=tilt.objective,
        counted_objective=counted.objective,
        distance_to_tilt=float(expected_log_ratio(pi1, tilt.pi1).mean()),
        distance_to_counted=float(expected_log_ratio(pi1, counted.pi1).mean()),
    )


class EpisodeTracker(Callback):
    """Every ``every`` PPO iterations (and after the last, ``total``), the :class:`EpisodeRow` of the policy against its
    (frozen) reference at the controller's beta, as a dict with its ``iteration``."""

    def __init__(self, every: int = 10, total: Optional[int] = None) -> None:
        self.every, self.total = every, total
        self.rows: list[dict[str, float]] = []
        self._fixed: Optional[tuple[Tensor, ...]] = None  # ref1, ref_obs, ref2, P, rewards

    def on_train_start(self, trainer, pl_module: ExactEpisodePPORLHF) -> None:
        task = pl_module.task
        self._fixed = (*pl_module.exact_episode_ref(), task.obs_probs(), task.rewards())
        self.rows.append(self._row(pl_module, 0))

    def on_train_batch_end(self, trainer, pl_module: ExactEpisodePPORLHF, outputs, batch, batch_idx) -> None:
        if pl_module.iteration % self.every == 0 or pl_module.iteration == self.total:
            self.rows.append(self._row(pl_module, pl_module.iteration))

    def _row(self, pl_module: ExactEpisodePPORLHF, iteration: int) -> dict[str, float]:
        pi1, _, pi2 = pl_module.exact_episode()
        return {"iteration": iteration, **vars(episode_report(pi1, pi2, *self._fixed, float(pl_module.exact_beta())))}

    @property
    def last(self) -> dict[str, float]:
        return self.rows[-1]
