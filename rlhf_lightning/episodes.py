"""Episodes: the policy writes a turn, an environment answers, the policy writes again (``model.environment``).

An episode is a ``Sampler.draw`` that runs turn by turn (docs/environments.md):

1. each row's environment is ``reset`` with its prompt and a seed of (run, rank, iteration, row);
2. the rollout engine draws one turn for every row still running, its context the prompt then the episode so far,
   token ids exactly as drawn and as appended (never re-tokenised): a turn ends at EOS or at
   ``model.sampling.max_new_tokens``;
3. the environment ``step``s on each turn: a reward (credited to the turn's last token), ``done``, or an observation,
   appended as the environment's turn (its ids as given, or its text in the environment's chat role where the
   tokenizer has a chat template), and the next turn starts;
4. an episode also ends at ``max_turns`` policy turns, when the next turn could pass ``max_total_tokens``, or on an
   observation longer than ``max_observation_tokens`` (not appended); each end is counted (``env/ended_by_*``).

The result is one token sequence per row (the prompt, then the turns), the engine's scores of the policy's tokens at
their positions, and an :class:`EpisodeLayout`: which positions are the policy's (``policy_mask``, what the KL, the
loss, the entropy and the advantages' credit cover), which are the episode's at all (``episode_mask``: the attention
mask's), each token's turn and the environment's per-turn rewards. The environment's tokens are state: context for
what follows, never actions.

The environment's calls run in a few reused daemon threads (:class:`EnvironmentCalls`); one that raises, or does not
answer within its ``timeout_s``, stops the run with one line naming it (:class:`EnvironmentFault`, exit 2).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from rlhf_lightning.checks import ConfigError, context_field, require
from rlhf_lightning.interfaces import Environment, Samples, Step

# How each episode ended (EpisodeLayout.ended_by): its environment's done, or a limit.
ENDINGS = ("environment", "max_turns", "max_total_tokens", "observation_too_long")
_PLACEHOLDER = "\x00OBSERVATION\x00"


class EnvironmentFault(ConfigError):
    """An environment raised or did not answer in time: one line naming it and the setting (exit 2)."""


class EnvironmentInterrupted(EnvironmentFault):
    """Ctrl+C while the run waited for an environment: one line, and the shell's status for SIGINT (130)."""

    status = 130


_POLL_S = 0.25  # an environment's answer is awaited in slices this long: a Ctrl+C is seen between them


@dataclass
class EpisodeLayout:
    """Where each token of a batch of episodes came from. Per-token tensors are (batch, episode_len), the episode's
    positions after the prompt; per-episode (batch,)."""

    policy_mask: Tensor  # 1 on the policy's tokens (each turn up to and including its EOS)
    episode_mask: Tensor  # 1 on every token of the episode, the policy's and the environment's
    turns: Tensor  # long: each token's turn (0, 1, 2, ...: the policy's even, the environment's odd), -1 after the episode
    turn_rewards: Tensor  # the environment's reward of each policy turn, at the turn's last token; 0 elsewhere
    ended_with_eos: Tensor  # bool: the episode's last policy turn ended at EOS (not cut at max_new_tokens)
    policy_turns: Tensor  # long: the policy's turns
    turns_cut: Tensor  # long: the policy's turns cut at max_new_tokens
    tool_calls: Tensor  # long: turns whose step said info["tool_call"]
    tool_ok: Tensor  # long: of those, the ones that said info["tool_ok"]
    ended_by: Tensor  # long: index into ENDINGS

    def state_dict(self) -> dict[str, Tensor]:
        return {name: value.cpu() for name, value in vars(self).items()}

    @classmethod
    def from_state(cls, state: dict[str, Tensor], device: torch.device) -> EpisodeLayout:
        return cls(**{name: value.to(device) for name, value in state.items()})


def observation_format(tokenizer, role: str) -> Optional[tuple[str, str]]:
    """The text around an environment's observation in ``role``, after the policy's turn (EOS included) and before
    the policy's next turn, from the tokenizer's chat template: ``(before, after)``, so that the observation's ids
    are ``tokenizer(before + text + after)``; None where the tokenizer has no chat template (the text alone). A
    template that refuses the role is refused at start-up, naming ``model.environment``."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    chat = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    try:
        base = tokenizer.apply_chat_template(chat, tokenize=False)
        full = tokenizer.apply_chat_template([*chat, {"role": role, "content": _PLACEHOLDER}], tokenize=False, add_generation_prompt=True)
    except Exception as err:  # a template's own error (jinja raises for a role it refuses)
        raise ConfigError(
            f"model.environment: the tokenizer's chat template cannot render the environment's role {role!r} ({err}); "
            "an environment whose role the template knows (user, tool), or model.prompts.chat_template: false"
        ) from err
    # The policy's turn ends at its EOS: what the template writes after the assistant's text and EOS comes first.
    closing = base[base.rindex("A") + 1 :]
    eos = tokenizer.eos_token or ""
    closing = closing[len(eos) :] if eos and closing.startswith(eos) else closing
    before, after = full[len(base) :].split(_PLACEHOLDER)
    return closing + before, after


def check_settings(environment: Optional[Environment], sampling) -> None:
    """At start-up, before any model loads: what an episode cannot serve. ``min_new_tokens`` bans EOS at each turn's
    first positions in the engine but at the episode's first positions in the trainer's declared distribution, so it
    is refused; ``policy_tokens_only: false`` (the environment's tokens in the KL and the loss: biased, kept to measure
    it) needs the trainer's own log-probs at the environment's tokens (``old_logprobs: forward``), and is warned of."""
    if environment is None:
        return
    require(
        sampling.min_new_tokens == 0,
        "model.sampling.min_new_tokens",
        "0 with model.environment (an EOS ban per turn is not declared to the trainer)",
        sampling.min_new_tokens,
    )
    if environment.policy_tokens_only:
        return
    require(
        sampling.old_logprobs == "forward" and sampling.rollout_correction == "none",
        "model.sampling.old_logprobs",
        "'forward' (and model.sampling.rollout_correction: none) with environment.policy_tokens_only: false "
        "(the sampler has no log-probs of the environment's tokens)",
        sampling.old_logprobs,
    )
    warnings.warn(
        f"model.environment {type(environment).__name__} with policy_tokens_only: false: the environment's tokens are "
        "in the KL, the loss and the advantages' credit as if the policy chose them, which teaches the policy to predict "
        "the environment and does not reach the KL-regularised optimum (docs/environments.md); policy_tokens_only: true "
        "(the default) leaves them out",
        UserWarning,
        stacklevel=2,
    )


def most_tokens(environment: Optional[Environment], max_new_tokens: int) -> int:
    """The most tokens a row's response (an episode's, after the prompt) can hold: ``max_new_tokens`` without an
    environment; with one, ``max_turns`` turns of ``max_new_tokens`` and the environment's turns between them of at
    most ``max_observation_tokens``, within ``max_total_tokens`` where it is set (what the memory estimate counts)."""
    if environment is None:
        return max_new_tokens
    turns = environment.max_turns
    most = turns * max_new_tokens + (turns - 1) * environment.max_observation_tokens
    return most if environment.max_total_tokens is None else min(most, environment.max_total_tokens)


def token_bound(environment: Environment, sampling, config: Any, longest_prompt: Optional[int]) -> Optional[int]:
    """The episode's tokens after the prompt, at most: ``max_total_tokens``, else what the policy's context (its
    ``config``) leaves after the longest prompt (``longest_prompt``; one token when unknown); None where neither is
    known. Refused (naming ``environment.max_total_tokens``) where one turn does not fit or it passes the context."""
    name = context_field(config)
    room = None if name is None else getattr(config, name) - (longest_prompt or 1)
    bound = environment.max_total_tokens if environment.max_total_tokens is not None else room
    if environment.max_total_tokens is not None and room is not None:
        require(
            bound <= room,
            "environment.max_total_tokens",
            f"<= {room}: the policy's context ({type(config).__name__}'s {name} {getattr(config, name)}) less the longest prompt",
            bound,
        )
    if bound is not None:
        require(
            bound >= sampling.max_new_tokens,
            "environment.max_total_tokens",
            f">= model.sampling.max_new_tokens ({sampling.max_new_tokens}): one policy turn must fit",
            bound,
        )
    return bound


class EnvironmentCalls:
    """Runs an environment's calls (``reset``, ``step``) in a few daemon threads, reused from one call to the next (a
    thread per call runs out of threads on a loaded machine, at hundreds of rows), each call's result awaited within
    ``timeout_s``: else :class:`EnvironmentFault` naming it (a hung call's thread is left behind and never keeps the
    process alive). ``workers`` 1: one call at a time (an environment that is not thread-safe)."""

    def __init__(self, what: str, timeout_s: float, workers: int) -> None:
        self.what, self.timeout_s, self.workers = what, timeout_s, workers
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []

    def _serve(self) -> None:
        while True:
            call, done, out = self.queue.get()
            try:
                out["value"] = call()
            except BaseException as err:  # reported in the caller's thread
                out["error"] = err
            done.set()

    def map(self, calls: Sequence[Callable[[], Any]], name: str) -> list[Any]:
        """Each of ``calls`` run by the workers (started as needed, up to ``workers``); their results in order, or
        the first fault: a call that raised, or one not answered ``timeout_s`` after the wait for it began."""
        while len(self.threads) < min(self.workers, len(calls)):
            thread = threading.Thread(target=self._serve, name="rlhf-lightning-environment", daemon=True)
            thread.start()
            self.threads.append(thread)
        pending = [(threading.Event(), {}) for _ in calls]
        for call, (done, out) in zip(calls, pending, strict=True):
            self.queue.put((call, done, out))
        results = []
        for done, out in pending:
            if not self._wait(done, name):
                raise EnvironmentFault(
                    f"{self.what}.{name} did not answer within {self.timeout_s:g} s (model.environment.init_args.timeout_s)"
                )
            if "error" in out:
                err = out["error"]
                raise EnvironmentFault(f"{self.what}.{name} raised {type(err).__name__}: {err} (model.environment)") from err
            results.append(out["value"])
        return results

    def _wait(self, done: threading.Event, name: str) -> bool:
        """Whether ``done`` is set within ``timeout_s``, waited for in slices of ``_POLL_S``; a Ctrl+C meanwhile is one
        line (:class:`EnvironmentInterrupted`), the calls in flight left to their daemon threads."""
        deadline = time.monotonic() + self.timeout_s
        try:
            while not done.wait(max(0.0, min(_POLL_S, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    return False
        except KeyboardInterrupt:
            raise EnvironmentInterrupted(
                f"stopped by Ctrl+C while waiting for {self.what}.{name} (model.environment.init_args.timeout_s "
                f"{self.timeout_s:g}); the iteration under way is not saved"
            ) from None
        return True


@dataclass
class _Episode:
    """One row's episode while it is drawn: its segments of ids, and the engine's scores of the policy's."""

    prompt_ids: list[int]
    state: Any = None
    ids: list[int] = field(default_factory=list)
    turn_of: list[int] = field(default_factory=list)  # each id's turn
    policy: list[bool] = field(default_factory=list)
    scores: list[tuple[int, int, int]] = field(default_factory=list)  # (turn's draw, its row, tokens): where its scores are
    rewards: dict[int, float] = field(default_factory=dict)  # position of a turn's last token -> the environment's reward
    turn: int = 0
    ended_by: Optional[int] = None
    ended_with_eos: bool = False
    policy_turns: int = 0
    turns_cut: int = 0
    tool_calls: int = 0
    tool_ok: int = 0

    def append(self, ids: Sequence[int], policy: bool) -> None:
        self.ids.extend(ids)
        self.turn_of.extend([self.turn] * len(ids))
        self.policy.extend([policy] * len(ids))
        self.turn += 1

    def end(self, how: str) -> None:
        self.ended_by = ENDINGS.index(how)


class EpisodeDraw:
    """Draws a batch of episodes with a rollout engine and an environment (module docstring). Built once by the
    sampler with its tokenizer, the environment, the turn's token bound (``model.sampling.max_new_tokens``) and the
    episode's (``token_bound``)."""

    def __init__(self, tokenizer, environment: Environment, max_new_tokens: int, max_total_tokens: Optional[int] = None) -> None:
        self.tokenizer, self.environment, self.max_new_tokens = tokenizer, environment, max_new_tokens
        self.max_total_tokens = max_total_tokens  # the episode's tokens after the prompt (token_bound)
        self.name = f"environment {type(environment).__name__}"
        self.format = observation_format(tokenizer, environment.role)
        self.calls = EnvironmentCalls(self.name, environment.timeout_s, 8 if environment.thread_safe else 1)

    def observation_ids(self, step: Step, turn_ended_with_eos: bool) -> list[int]:
        """The ids of the environment's turn: ``step.observation_ids`` as they are, or its text encoded in the
        environment's chat role (a turn cut before EOS is closed by the template's own text)."""
        if step.observation_ids is not None:
            return [int(i) for i in step.observation_ids]
        text = step.observation or ""
        if self.format is not None:
            before, after = self.format
            if not turn_ended_with_eos and self.tokenizer.eos_token:
                before = self.tokenizer.eos_token + before
            text = before + text + after
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def draw(self, sampler, prompts: list[str], enc: dict[str, Tensor], seed: int) -> tuple[Samples, EpisodeLayout]:
        """Episodes for the rows ``prompts`` (encoded: ``enc``, left-padded) with ``sampler``'s engine at ``seed``:
        the rows' sequences (the prompts as in ``enc``, then the episodes, right-padded) with the engine's scores
        at the policy's positions, and their layout."""
        env, engine, pad = self.environment, sampler.engine, self.tokenizer.pad_token_id
        episodes = [_Episode(ids[mask.bool()].tolist()) for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)]
        resets = [lambda p=prompt, s=seed + 31 * row: env.reset(p, s) for row, prompt in enumerate(prompts)]
        for episode, state in zip(episodes, self.calls.map(resets, "reset"), strict=True):
            episode.state = state
        draws: list[Samples] = []
        for turn in range(env.max_turns):
            rows = [row for row, episode in enumerate(episodes) if episode.ended_by is None]
            if not rows:
                break
            context = enc if turn == 0 else left_pad([episodes[r].prompt_ids + episodes[r].ids for r in rows], pad, sampler.device)
            samples = engine.checked_sample(sampler, context, seed + 7 * turn)
            draws.append(samples)
            new = samples.sequences[:, context["input_ids"].shape[1] :].tolist()
            steps = self._step([(episodes[r], new[i]) for i, r in enumerate(rows)], len(draws) - 1, rows)
            for r, step in zip(rows, steps, strict=True):
                self._answer(episodes[r], step, last_turn=turn == env.max_turns - 1)
        return self._assemble(episodes, enc, draws, sampler.device)

    def _step(self, turns: list[tuple[_Episode, list[int]]], draw: int, rows: list[int]) -> list[Step]:
        """Each row's drawn turn cut at its EOS, kept in its episode, and the environment's step on it (the rows'
        calls side by side in the workers where the environment is thread-safe)."""
        eos, env = self.tokenizer.eos_token_id, self.environment
        texts = []
        for i, (episode, new) in enumerate(turns):
            length = new.index(eos) + 1 if eos in new else len(new)
            ids = new[:length]
            episode.ended_with_eos = eos in ids
            episode.turns_cut += not episode.ended_with_eos
            episode.policy_turns += 1
            episode.scores.append((draw, i, length))
            episode.append(ids, policy=True)
            texts.append((episode, self.tokenizer.decode(ids, skip_special_tokens=True), ids))
        return self.calls.map([lambda e=episode, t=text, ids=ids: env.step(e.state, t, ids) for episode, text, ids in texts], "step")

    def _checked(self, step: Any) -> Step:
        if not isinstance(step, Step):
            raise EnvironmentFault(f"{self.name}.step returned {type(step).__name__}, not a Step (rlhf_lightning.interfaces.Step)")
        return step

    def _answer(self, episode: _Episode, step: Step, last_turn: bool) -> None:
        """The environment's answer in ``episode``: its reward at the turn's last token, then the episode's end or the
        environment's turn appended."""
        step = self._checked(step)
        env = self.environment
        if step.reward is not None:
            reward = float(step.reward)
            if reward != reward or abs(reward) == float("inf"):
                raise EnvironmentFault(f"{self.name}.step returned the reward {reward} (a finite number or None)")
            episode.rewards[len(episode.ids) - 1] = episode.rewards.get(len(episode.ids) - 1, 0.0) + reward
        episode.tool_calls += bool(step.info.get("tool_call"))
        episode.tool_ok += bool(step.info.get("tool_call") and step.info.get("tool_ok"))
        if step.done:
            return episode.end("environment")
        if last_turn:
            return episode.end("max_turns")
        ids = self.observation_ids(step, episode.ended_with_eos)
        if len(ids) > env.max_observation_tokens:
            return episode.end("observation_too_long")
        bound = self.max_total_tokens
        if bound is not None and len(episode.ids) + len(ids) + self.max_new_tokens > bound:
            return episode.end("max_total_tokens")
        episode.append(ids, policy=False)

    def _assemble(self, episodes: list[_Episode], enc: dict[str, Tensor], draws: list[Samples], device) -> tuple[Samples, EpisodeLayout]:
        """The rows right-padded to the longest episode: the sequences, the engine's scores of the policy's tokens at
        their positions (zeros elsewhere: masked), and the layout."""
        batch, length, pad = len(episodes), max(len(e.ids) for e in episodes), self.tokenizer.pad_token_id
        response = torch.full((batch, length), pad, dtype=torch.long)
        policy_mask, episode_mask = torch.zeros(batch, length), torch.zeros(batch, length)
        turns, turn_rewards = torch.full((batch, length), -1, dtype=torch.long), torch.zeros(batch, length)
        first = draws[0]
        logits = None if first.logits is None else first.logits.new_zeros(batch, length, first.logits.shape[-1])
        logprobs = None if first.logprobs is None else first.logprobs.new_zeros(batch, length)
        hidden = None if first.hidden is None else first.hidden.new_zeros(batch, length, first.hidden.shape[-1])
        for row, episode in enumerate(episodes):
            n = len(episode.ids)
            response[row, :n] = torch.tensor(episode.ids, dtype=torch.long)
            episode_mask[row, :n] = 1.0
            policy_mask[row, :n] = torch.tensor(episode.policy, dtype=torch.float32)
            turns[row, :n] = torch.tensor(episode.turn_of, dtype=torch.long)
            for position, reward in episode.rewards.items():
                turn_rewards[row, position] = reward
            positions = policy_mask[row].nonzero().flatten().tolist()
            start = 0
            for draw, i, tokens in episode.scores:  # the policy's turns in order: their scores at their positions
                at = torch.tensor(positions[start : start + tokens])
                start += tokens
                for out, source in ((logits, draws[draw].logits), (logprobs, draws[draw].logprobs), (hidden, draws[draw].hidden)):
                    if out is not None:
                        out[row, at] = source[i, :tokens].to(out.device, out.dtype)
        sequences = torch.cat([enc["input_ids"].cpu(), response], dim=1).to(device)
        to = dict(device=device)
        layout = EpisodeLayout(
            policy_mask=policy_mask.to(**to),
            episode_mask=episode_mask.to(**to),
            turns=turns.to(**to),
            turn_rewards=turn_rewards.to(**to),
            ended_with_eos=torch.tensor([e.ended_with_eos for e in episodes], **to),
            policy_turns=torch.tensor([e.policy_turns for e in episodes], **to),
            turns_cut=torch.tensor([e.turns_cut for e in episodes], **to),
            tool_calls=torch.tensor([e.tool_calls for e in episodes], **to),
            tool_ok=torch.tensor([e.tool_ok for e in episodes], **to),
            ended_by=torch.tensor([e.ended_by for e in episodes], **to),
        )
        return Samples(sequences, logits, logprobs, hidden), layout


def turn_texts(rollout, tokenizer, role: str) -> list[list[tuple[str, str]]]:
    """Each episode of ``rollout`` (a Trajectory with an ``episode``) as its turns in order, ``(role, text)``: the
    policy's as ``assistant``, the environment's in its ``role``; special tokens left out."""
    out = []
    for response, turns, policy in zip(
        rollout.responses.tolist(), rollout.episode.turns.tolist(), rollout.episode.policy_mask.tolist(), strict=True
    ):
        segments: dict[int, list[int]] = {}
        for token, turn in zip(response, turns, strict=True):
            if turn >= 0:
                segments.setdefault(turn, []).append(token)
        roles = {turn: "assistant" if p else role for turn, p in zip(turns, policy, strict=True)}
        out.append([(roles[t], tokenizer.decode(ids, skip_special_tokens=True)) for t, ids in segments.items()])
    return out


def left_pad(rows: list[list[int]], pad: int, device) -> dict[str, Tensor]:
    """Token-id rows as an engine's input: left-padded with ``pad``, the attention mask 1 on every id given (the ids
    as they are: a pad or EOS id inside a row is a real token)."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, width - len(r) :] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
