"""Episodes (rlhf_lightning/episodes.py): the ids the trainer and the reference score are the ids drawn plus the
environment's, the masks say which are the policy's, and every per-token quantity reads the policy's mask; checked
by hand on two-turn episodes of the tiny model with its character tokenizer."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.episodes import ENDINGS, EnvironmentFault, observation_format
from rlhf_lightning.sampler import Drawn

from helpers import Echo, Scripted, fit, make_module


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


def test_token_in_token_out_on_the_real_tokenizer_with_its_chat_template(smollm2_tokenizer):
    """SmolLM2's tokenizer and chat template on a tiny random model: each turn's context is the prompt, the policy's ids
    as drawn and the tool's turn rendered in its role; the trainer's forward over the episode gives the log-probs the
    sampler drew the policy's tokens with (sampler and trainer score the same ids at the same positions)."""
    tiny = {"hidden_size": 32, "intermediate_size": 64}
    env = Echo(text="42", turns=3, max_turns=3)
    module = make_module(tokenizer="smollm2", tiny_config=tiny, environment=env, sampling=dict(max_new_tokens=5, old_logprobs="forward"))
    tok, engine = module.tokenizer, module.sampler.engine
    contexts = []

    def recording(sampler, enc, seed):
        contexts.append([ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)])
        return type(engine).checked_sample(engine, sampler, enc, seed)

    engine.checked_sample = recording
    drawn = module.sampler.draw(["What is 6 x 7?", "Say hi."], 0, 0)
    rollout = module.sampler.trajectory(drawn)
    before, after = observation_format(tok, "tool")
    assert (before, after) == ("\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")
    episode = drawn.episode
    for row in range(2):
        prompt = contexts[0][row]
        ids_row = rollout.input_ids[row][rollout.attention_mask[row].bool()].tolist()
        turns = episode.turns[row][episode.episode_mask[row].bool()].tolist()
        first = [i for i, t in zip(ids_row[len(prompt) :], turns, strict=True) if t == 0]
        tool = [i for i, t in zip(ids_row[len(prompt) :], turns, strict=True) if t == 1]
        closing = "" if first[-1] == tok.eos_token_id else tok.eos_token
        assert tool == tok(closing + before + "42" + after, add_special_tokens=False)["input_ids"]
        assert contexts[1][row] == prompt + first + tool  # turn 2 drew after exactly these ids
    mask = rollout.response_mask.bool()
    assert torch.allclose(rollout.trainer_logprobs[mask], rollout.sampler_logprobs[mask], atol=1e-4)
    assert rollout.trainer_logprobs[mask].std() > 0.01  # tokens told apart far beyond the tolerance: a shifted position would fail


def test_the_asynchronous_sampler_draws_episodes_ahead_and_weighs_the_policy_s_tokens_only(tmp_path):
    """k = 1 with the sampler in its thread: each iteration's episodes are what the weights one update old draw at the
    iteration's seed (turn by turn, the environment's ids included), and the sequence correction's weight is the
    product over the policy's tokens alone."""
    from helpers import RecordWeights

    settings = dict(environment=Echo(text="ok", turns=2), sampling=dict(old_logprobs="forward", max_new_tokens=4), ppo=dict(epochs=1))
    module = make_module(**settings, off_policy=dict(max_staleness=1))
    module.async_rollouts.concurrent = True
    weights = RecordWeights()
    _, history = fit(module, tmp_path, 3, batch_size=4, callbacks=[weights])
    for i, out in enumerate(history.outputs):
        rollout = out["rollout"]
        assert rollout.policy_version.tolist() == [max(0, i - 1)] * len(rollout.prompts)
        fresh = make_module(**settings)
        with torch.no_grad():
            for name, p in fresh.policy.named_parameters():
                p.copy_(weights.versions[max(0, i - 1)][name])
        fresh.sampler.generation_seed_base = module.sampler.generation_seed_base
        by_hand = fresh.sampler.draw(rollout.prompts, i, i)
        assert torch.equal(by_hand.episode.episode_mask, rollout.episode.episode_mask)
        restored = Drawn.from_state(by_hand.state_dict(), torch.device("cpu")).episode  # a checkpoint of the batches drawn ahead
        assert all(torch.equal(getattr(restored, k), v) for k, v in vars(by_hand.episode).items())
        n = rollout.responses.shape[1]
        assert torch.equal(by_hand.samples.sequences[:, -n:] * rollout.episode.episode_mask.long(), rollout.responses)
        log_ratio = ((rollout.trainer_logprobs - rollout.sampler_logprobs) * rollout.response_mask).sum(-1)
        expected = log_ratio.exp().clamp(max=5.0).unsqueeze(-1).expand_as(rollout.response_mask)
        assert torch.allclose(rollout.is_weights[rollout.response_mask.bool()], expected[rollout.response_mask.bool()], rtol=1e-5)
    assert history.rows[-1]["env/turns"] == 2.0


def test_the_environment_in_the_docs_runs_as_written():
    """docs/environments.md's example, executed as written, registered, and run for one episode per row."""
    import re
    from pathlib import Path

    from rlhf_lightning.registry import registry

    page = (Path(__file__).resolve().parent.parent / "docs" / "environments.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    if "echo_twice" not in registry("environment"):
        exec(compile(code, "docs/environments.md", "exec"), {})
    module = make_module(environment="echo_twice", sampling=dict(max_new_tokens=4))
    module.sampler.engine = Scripted([[[4, 5, 1]], [[6, 1]]])
    episode = module.sampler.draw(["a"], 0, 0).episode
    assert episode.turns.tolist()[0][:3] == [0, 0, 0] and episode.ended_by.tolist() == [ENDINGS.index("environment")]
    assert episode.turn_rewards.sum() == 1.0 and episode.policy_turns.tolist() == [2]


def test_episodes_with_lora_and_per_prompt_budgets(tmp_path):
    """LoRA trains the adapter alone and a per-prompt controller moves each prompt's beta by its episodes' KL, which
    is over the policy's tokens: the environment's tokens change nothing in it."""
    from rlhf_lightning_plugins.beta_controllers import PromptBudgetBeta

    controller = PromptBudgetBeta(init_beta=0.1, target=0.01, horizon=4)
    env = Echo(text="zz", turns=2)
    module = make_module(environment=env, beta_controller=controller, lora=dict(rank=4), sampling=dict(max_new_tokens=4))
    base = {n: p.detach().clone() for n, p in module.policy.named_parameters() if "lora" not in n}
    lora_before = [p.detach().clone() for p in module.policy.parameters()]
    _, history = fit(module, tmp_path, 2)
    # The base weights as they were (to within the rounding of merging the adapter for each turn's draw and back).
    assert all(torch.allclose(p, base[n], atol=1e-6) for n, p in module.policy.named_parameters() if "lora" not in n)
    assert any(not torch.equal(p, q) for p, q in zip(module.policy.parameters(), lora_before, strict=True))
    out = history.outputs[-1]
    rollout, stats = out["rollout"], out["prompts"]
    assert torch.equal(out["kl"] * (1 - rollout.response_mask), torch.zeros_like(out["kl"]))  # no KL at the environment's tokens
    assert len(set(controller.betas.values())) > 1 and stats.kl.max() > 0


def test_two_ranks_run_their_own_episodes_and_a_resume_continues_them(tmp_path):
    """Through the command, from a fresh folder: configs/tiny.yaml with the guessing game on 2 DDP ranks (each rank's
    environments its own, seeded by rank) for an epoch of 2 iterations, then resumed from its checkpoint for a second."""
    from tools.summarize_run import read_scalars

    from helpers import run_cli

    game = ("--model.environment=guess_number", "--model.environment.init_args.max_turns=2", "--model.sampling.max_new_tokens=6")
    ddp = ("--trainer.devices=2", "--trainer.strategy=ddp", "--data.batch_size=4")
    first = run_cli(tmp_path, *game, *ddp, "--trainer.limit_train_batches=2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli(tmp_path, *game, *ddp, "--trainer.limit_train_batches=2", "--trainer.max_epochs=2", "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    runs = sorted((tmp_path / "lightning_logs" / "tiny").glob("version_*"))
    first_run, second_run = (read_scalars(str(run)) for run in runs)
    assert sorted(first_run["env/turns"]) == [0, 1] and sorted(second_run["env/turns"]) == [2, 3]  # steps: iterations 0-3
    for scalars in (first_run, second_run):
        assert all(1.0 <= turns <= 2.0 for turns in scalars["env/turns"].values())
        assert all(0.0 < share < 1.0 for share in scalars["env/environment_token_share"].values())


def test_every_kl_estimator_and_placement_leaves_the_environment_s_tokens_out_of_the_loss():
    """For each registered KL estimator in the reward, the loss and both (settings the start-up checks refuse are
    skipped): the KL is zero at the environment's tokens, and the gradient of the whole update's loss (policy loss, KL
    term, entropy) with respect to the policy's logits is zero there and not at the policy's tokens."""
    from rlhf_lightning.checks import ConfigError
    from rlhf_lightning.registry import registry

    tried = 0
    for name in registry("kl_estimator").names():
        for placement in ("reward", "loss", "both"):
            kl = dict(placement=placement, loss_scope="sequence")
            try:
                module = make_module(
                    environment=Echo(answer=[7, 8], turns=2),
                    kl_estimator=name,
                    kl=kl,
                    ppo=dict(whiten_advantages=placement == "reward", entropy_coef=0.01),
                )
            except (ConfigError, ValueError):
                continue
            tried += 1
            module.sampler.engine = Scripted([[[4, 5, 1], [5, 1]], [[6, 1], [4, 4, 1]]])
            rollout = module.sampler.trajectory(module.sampler.draw(["a", "b"], 0, 0))
            environment = rollout.episode.episode_mask.bool() & ~rollout.response_mask.bool()
            betas = torch.full((2,), 0.5, dtype=torch.float64)
            scored = module.score(rollout, betas)
            assert not scored.kl[environment].any() and not scored.rewards[environment].any(), (name, placement)
            advantages, returns = module.compute_advantages(scored.rewards, rollout)
            captured = {}
            outputs = module.networks.policy_outputs

            def keep(*a, outputs=outputs, captured=captured, **kw):
                logits, values = outputs(*a, **kw)
                captured["logits"] = logits
                return logits, values

            module.networks.policy_outputs = keep
            module.update.terms = {}
            loss = module.update.loss(
                rollout, advantages, returns, torch.arange(2), betas.float(), rollout.response_mask / rollout.response_mask.sum()
            )
            (grad,) = torch.autograd.grad(loss, captured["logits"])
            assert grad[environment].abs().max() == 0, (name, placement)
            assert grad[rollout.response_mask.bool()].abs().sum() > 0, (name, placement)
    assert tried >= 12, tried


def test_the_environment_s_calls_reuse_a_few_threads():
    """Hundreds of rows over many draws start at most 8 threads (one per call ran out of threads on a loaded machine)."""
    import threading

    module = make_module(environment=Echo(answer=[7], turns=2), sampling=dict(max_new_tokens=3))
    module.sampler.engine = Scripted([[[4, 1]] * 300, [[5, 1]] * 300])
    before = threading.active_count()
    for i in range(3):
        module.sampler.engine.contexts.clear()  # the scripted turns start again
        episode = module.sampler.draw(["a"] * 300, i, i).episode
        assert episode.policy_turns.tolist() == [2] * 300
    assert threading.active_count() - before <= 8


def test_the_most_tokens_an_episode_holds_bound_the_memory_estimate():
    from rlhf_lightning.episodes import most_tokens

    assert most_tokens(None, 24) == 24
    assert most_tokens(Echo(max_turns=3, max_observation_tokens=10), 24) == 3 * 24 + 2 * 10
    assert most_tokens(Echo(max_turns=3, max_observation_tokens=10, max_total_tokens=50), 24) == 50


def test_ctrl_c_while_an_environment_answers_is_one_line_and_status_130(tmp_path):
    """Through the command: an environment that takes its time, a Ctrl+C (SIGINT, twice: the first lets the iteration
    finish) while the run waits for it, and the run ends at once with one line naming the environment and exit 130."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import CONFIGS, REPO

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    args = ["fit", "--config", str(CONFIGS / "tiny.yaml"), "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0"]
    args += ["--model.environment=helpers.Slow", "--model.sampling.max_new_tokens=4"]
    run = subprocess.Popen([sys.executable, "-m", "rlhf_lightning.cli", *args], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    marker = tmp_path / "stepping"
    deadline = time.monotonic() + 300
    while not marker.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), run.stderr.read() if run.poll() is not None else "no step in 300 s"
    run.send_signal(signal.SIGINT)
    time.sleep(1.0)
    run.send_signal(signal.SIGINT)
    started = time.monotonic()
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, stderr[-3000:]
    assert time.monotonic() - started < 60  # not the environment's 600 s
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: stopped by Ctrl+C while waiting for environment Slow.step"), last
