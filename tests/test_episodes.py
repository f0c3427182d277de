"""Episodes (rlhf_lightning/episodes.py): the ids the trainer and the reference score are the ids drawn plus the
environment's, the masks say which are the policy's, and every per-token quantity reads the policy's mask; checked
by hand on two-turn episodes of the tiny model with its character tokenizer."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.episodes import ENDINGS, EnvironmentFault, observation_format
from rlhf_lightning.interfaces import Environment, Samples, Step

from helpers import fit, make_module


class Scripted:
    """A rollout engine that answers each turn with fixed ids per row and turn (log-probs -1 each) and records the
    contexts it was handed."""

    def __init__(self, turns: list[list[list[int]]]) -> None:
        self.turns, self.contexts = turns, []

    def stale(self, module) -> bool:
        return False

    def checked_sample(self, module, enc, seed) -> Samples:
        turn = len(self.contexts)
        self.contexts.append([ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)])
        rows = [list(r) for r in self.turns[turn][: len(enc["input_ids"])]]
        width = max(map(len, rows))
        new = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        return Samples(torch.cat([enc["input_ids"], new], dim=1), logprobs=torch.full(new.shape, -1.0))


class Echo(Environment):
    """Answers each turn with the ids ``answer`` (or the text ``text``), reward ``reward`` per turn; done after
    ``turns`` policy turns."""

    def __init__(self, answer=None, text=None, reward=None, turns: int = 2, **limits) -> None:
        super().__init__(**limits)
        self.answer, self.text, self.reward, self.turns = answer, text, reward, turns

    def reset(self, prompt, seed):
        return {"turn": 0, "seeds": seed}

    def step(self, state, turn_text, turn_ids):
        state["turn"] += 1
        done = state["turn"] >= self.turns
        return Step(
            observation=self.text, observation_ids=self.answer, reward=self.reward, done=done, info={"tool_call": True, "tool_ok": not done}
        )


def ids(tok, text: str) -> list[int]:
    return tok.convert_tokens_to_ids(list(text))


def test_two_turn_episode_keeps_the_ids_as_drawn_and_masks_the_policy_s_tokens():
    module = make_module(environment=Echo(answer=None, reward=0.5, max_turns=3), sampling=dict(max_new_tokens=3))
    sampler, tok = module.sampler, module.tokenizer
    eos = tok.eos_token_id
    module.environment.answer = ids(tok, "xy")
    a, b = ids(tok, "ab")
    # Row 0: "ab<eos>" then the environment's "xy", then "b<eos>"; row 1: "bbb" cut at max_new_tokens, "xy", "a<eos>".
    engine = Scripted([[[a, b, eos], [b, b, b]], [[b, eos], [a, eos]]])
    sampler.engine = engine
    drawn = sampler.draw(["ab", "c"], iteration=0, version=0)
    x, y = module.environment.answer
    episode = drawn.episode
    assert engine.contexts[1] == [[*ids(tok, "ab"), a, b, eos, x, y], [*ids(tok, "c"), b, b, b, x, y]]  # never re-tokenised
    response = drawn.samples.sequences[:, drawn.enc["input_ids"].shape[1] :]
    assert response.tolist() == [[a, b, eos, x, y, b, eos], [b, b, b, x, y, a, eos]]
    assert episode.policy_mask.tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 1, 1]]
    assert episode.episode_mask.tolist() == [[1] * 7, [1] * 7]
    assert episode.turns.tolist() == [[0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 2, 2]]
    assert episode.turn_rewards.tolist() == [[0, 0, 0.5, 0, 0, 0, 0.5], [0, 0, 0.5, 0, 0, 0, 0.5]]
    assert episode.ended_by.tolist() == [ENDINGS.index("environment")] * 2
    assert episode.turns_cut.tolist() == [0, 1] and episode.ended_with_eos.tolist() == [True, True]
    assert episode.tool_calls.tolist() == [2, 2] and episode.tool_ok.tolist() == [1, 1]
    # The engine's log-probs at the policy's positions, zero at the environment's.
    assert drawn.samples.logprobs.tolist() == [[-1, -1, -1, 0, 0, -1, -1], [-1, -1, -1, 0, 0, -1, -1]]

    rollout = sampler.trajectory(drawn)
    assert torch.equal(rollout.input_ids[:, -7:], response)  # the trainer and the reference score exactly these ids
    assert torch.equal(rollout.response_mask, episode.policy_mask)
    assert rollout.attention_mask[:, -7:].tolist() == episode.episode_mask.tolist()
    # The reference's log-probs are those of a forward pass over the same ids: the policy's at the start.
    logits = module.policy(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits[:, -8:-1]
    assert torch.allclose(rollout.ref_logprobs * rollout.response_mask, pm.logprobs_of(logits, response) * rollout.response_mask, atol=1e-4)


def test_score_credits_the_environment_s_reward_to_its_turn_and_the_final_score_to_the_last_policy_token():
    module = make_module(environment=Echo(reward=0.25, max_turns=2))
    tok = module.tokenizer
    module.environment.answer = ids(tok, "x")
    a, b, eos = *ids(tok, "ab"), tok.eos_token_id
    module.sampler.engine = Scripted([[[a, eos]], [[b, b, eos]]])
    rollout = module.sampler.trajectory(module.sampler.draw(["ab"], iteration=0, version=0))
    scored = module.score(rollout, torch.zeros(1, dtype=torch.float64))  # beta 0: the rewards alone
    score = float(scored.scores[0])
    # Policy tokens at 0, 1 (turn 0), the environment's at 2, the policy's at 3, 4, 5: the last policy token is 5.
    assert scored.rewards[0].tolist() == pytest.approx([0, 0.25, 0, 0, 0, 0.25 + score])


def test_each_ending_is_counted_and_the_limits_hold():
    a, b = 4, 5  # any content ids
    module = make_module(environment=Echo(answer=[a, a, a], turns=9, max_turns=2))
    module.sampler.engine = Scripted([[[a, 1]], [[b, 1]]])
    assert module.sampler.draw(["a"], 0, 0).episode.ended_by.tolist() == [ENDINGS.index("max_turns")]
    module = make_module(environment=Echo(answer=[a, a, a], turns=9, max_observation_tokens=2))
    module.sampler.engine = Scripted([[[a, 1]]])
    episode = module.sampler.draw(["a"], 0, 0).episode
    assert episode.ended_by.tolist() == [ENDINGS.index("observation_too_long")] and episode.episode_mask.sum() == 2  # not appended
    module = make_module(environment=Echo(answer=[a], turns=9, max_total_tokens=14), sampling=dict(max_new_tokens=12))
    module.sampler.engine = Scripted([[[a, 1]]])
    assert module.sampler.draw(["a"], 0, 0).episode.ended_by.tolist() == [ENDINGS.index("max_total_tokens")]  # 2 + 1 + 12 > 14


def test_an_environment_that_raises_or_hangs_stops_the_run_naming_it():
    class Broken(Echo):
        def step(self, state, turn_text, turn_ids):
            raise KeyError("no such tool")

    class Hangs(Echo):
        def step(self, state, turn_text, turn_ids):
            import time

            time.sleep(30)

    for env, words in ((Broken(), "Broken.step raised KeyError"), (Hangs(timeout_s=0.2), "did not answer within 0.2 s")):
        module = make_module(environment=env)
        module.sampler.engine = Scripted([[[4, 1]]])
        with pytest.raises(EnvironmentFault, match=words):
            module.sampler.draw(["a"], 0, 0)


def test_gae_runs_over_the_policy_s_tokens_an_environment_s_turn_being_part_of_the_transition():
    # Policy tokens at 0, 1, 4, 5 (the environment's at 2, 3): GAE over them equals GAE on the packed row.
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1, 0]])
    rewards = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.4, 7.0, 7.0, 0.2, 0.1, 7.0]])
    advantages, returns = pm.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    r, v = [0.1, 0.2, 0.3, 1.0], [0.5, 0.4, 0.2, 0.1]
    expected, running = [0.0] * 4, 0.0
    for t in reversed(range(4)):  # the plain reverse loop
        delta = r[t] + 0.9 * (v[t + 1] if t < 3 else 0.0) - v[t]
        running = delta + 0.9 * 0.8 * running
        expected[t] = running
    at = [0, 1, 4, 5]
    assert advantages[0, at].tolist() == pytest.approx(expected)
    assert returns[0, at].tolist() == pytest.approx([e + x for e, x in zip(expected, v, strict=True)])
    assert advantages[0, [2, 3, 6]].tolist() == [0, 0, 0] and returns[0, [2, 3, 6]].tolist() == [0, 0, 0]
    # The final score at the last policy token (5), not at mask.sum() - 1 (3, an environment's token).
    assert pm.token_rewards(torch.tensor([2.0]), torch.zeros(1, 7), mask, 0.1).tolist() == [[0, 0, 0, 0, 0, 2.0, 0]]


def test_observation_format_follows_the_chat_template_after_the_policy_s_eos():
    from transformers import PreTrainedTokenizerFast

    from rlhf_lightning.models import char_tokenizer

    tok = char_tokenizer()
    assert observation_format(tok, "tool") is None  # no template: the text alone
    tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    before, after = observation_format(tok, "tool")
    assert (before, after) == ("\n[tool]", "<eos>\n[assistant]")  # the policy drew "<eos>": the template's "\n" follows


def test_a_run_with_an_environment_trains_and_logs_env_metrics(tmp_path):
    module = make_module(environment=Echo(text="ok", reward=0.1, turns=2), sampling=dict(max_new_tokens=4))
    _, history = fit(module, tmp_path, iterations=2)
    row = history.rows[-1]
    assert row["env/turns"] == 2.0 and row["env/ended_by_environment"] == 1.0 and row["env/tool_calls"] == 2.0
    rollout = history.outputs[-1]["rollout"]
    policy, episode = rollout.response_mask.sum(), rollout.episode.episode_mask.sum()
    assert row["env/environment_token_share"] == pytest.approx(float((episode - policy) / episode))
    assert row["response/length"] == pytest.approx(float(policy) / len(rollout.prompts))  # the policy's tokens only


def test_turn_texts_give_each_turn_its_role():
    from rlhf_lightning.episodes import turn_texts

    module = make_module(environment=Echo(turns=2, max_turns=2), sampling=dict(max_new_tokens=3))
    tok = module.tokenizer
    module.environment.answer = ids(tok, "xy")
    module.sampler.engine = Scripted([[[*ids(tok, "ab"), tok.eos_token_id]], [[*ids(tok, "c"), tok.eos_token_id]]])
    rollout = module.sampler.trajectory(module.sampler.draw(["a"], 0, 0))
    assert turn_texts(rollout, tok, "tool") == [[("assistant", "ab"), ("tool", "xy"), ("assistant", "c")]]


def test_settings_an_episode_cannot_serve_are_refused_before_models_load():
    from rlhf_lightning.checks import ConfigError

    with pytest.raises(ConfigError, match=r"model.sampling.min_new_tokens must be 0 with model.environment"):
        make_module(environment=Echo(), sampling=dict(min_new_tokens=2))
    with pytest.raises(ConfigError, match=r"model.sampling.old_logprobs must be 'forward'"):
        make_module(environment=Echo(policy_tokens_only=False))
    with pytest.warns(UserWarning, match="does not reach the KL-regularised optimum"):
        make_module(environment=Echo(policy_tokens_only=False), sampling=dict(old_logprobs="forward"))
    # The tiny policy's context is 512 positions: an episode bound past it, or below one turn, is refused.
    with pytest.raises(ConfigError, match=r"environment.max_total_tokens must be <= 511"):
        make_module(environment=Echo(max_total_tokens=600))
    with pytest.raises(ConfigError, match=r"environment.max_total_tokens must be >= model.sampling.max_new_tokens \(12\)"):
        make_module(environment=Echo(max_total_tokens=8))
    with pytest.raises(ConfigError, match=r"environment.max_turns must be an integer >= 1"):
        Echo(max_turns=0)
