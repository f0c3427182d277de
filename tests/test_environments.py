"""The built-in environments by hand (the calculator, guess_number) and the SkyRL-Gym adapter on a real
SkyRL-Gym environment: each reset and step with the numbers they must give."""

from __future__ import annotations

import re
import sys
import time

import pytest

from rlhf_lightning.interfaces import ConfigError, Step
from rlhf_lightning.registry import load_plugins, registry
from rlhf_lightning_plugins.environments import Calculator, GuessNumber, ToolError, evaluate, show
from rlhf_lightning_plugins.rewards.verifiable import ExactAnswerReward

load_plugins()


def test_the_environments_are_registered_by_their_short_names():
    environments = registry("environment")
    assert environments.get("calculator") is Calculator and environments.get("guess_number") is GuessNumber
    assert "skyrl_gym" in environments.names()


# ---- the calculator ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, value",
    [
        ("17 + 25", "42"),
        ("46 * 20", "920"),
        ("3 - 58", "-55"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),  # Python's modulo: the divisor's sign
        ("2 ** 10", "1024"),
        ("2 ** -3", "0.125"),
        ("(1 + 2) * -(3 - 5)", "6"),
        ("6 / 3", "2"),  # a float with an integer value is shown as the integer
        ("1 / 3", "0.333333333333"),  # 12 significant digits
        ("3 × 4 ÷ 2", "6"),  # the signs a model writes
        ("2^10", "1024"),  # a caret is a power, not XOR
        ("10 ** 29", "1" + "0" * 29),  # 30 digits: the largest below 10^30
    ],
)
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert show(evaluate(expression)) == value


HOSTILE = {
    "9 ** 9 ** 9": "result out of range",  # refused before it is computed: 9^(9^9) has 3.7e8 digits
    "10 ** 30": "result out of range",
    "(10 ** 29) * (10 ** 29)": "result out of range",
    "2 ** 100": "result out of range",
    "0.5 ** -1000": "result out of range",
    "1e308 * 10": "result out of range",  # inf
    "9" * 31: "result out of range",
    "1.0000001 ** 10 ** 29": "result out of range",  # OverflowError
    "1 / 0": "division by zero",
    "5 // 0": "division by zero",
    "5 % 0": "division by zero",
    "0 ** -1": "division by zero",
    "(-8) ** 0.5": "not a real number",  # complex in Python
    "__import__('os').system('true')": "only numbers, + - * / // % ** and parentheses",
    "open('/etc/passwd').read()": "only numbers, + - * / // % ** and parentheses",
    "abs(-1)": "only numbers, + - * / // % ** and parentheses",
    "x + 1": "only numbers, + - * / // % ** and parentheses",
    "'a' * 10": "only numbers, + - * / // % ** and parentheses",
    "[1] * 10 ** 9": "only numbers, + - * / // % ** and parentheses",
    "1 if 1 else 0": "only numbers, + - * / // % ** and parentheses",
    "(lambda: 1)()": "only numbers, + - * / // % ** and parentheses",
    "1, 234": "only numbers, + - * / // % ** and parentheses",
    "True + 1": "only numbers, + - * / // % ** and parentheses",
    "1j * 1j": "only numbers, + - * / // % ** and parentheses",
    "3 < 4": "only numbers, + - * / // % ** and parentheses",
    "1 << 9999": "only numbers, + - * / // % ** and parentheses",
    "17 +": "not an arithmetic expression",
    "((((((((((": "not an arithmetic expression",
    "\x00": "not an arithmetic expression",
    "(" * 60 + "1" + ")" * 60: "expression longer than 100 characters",
    "1+" * 60 + "1": "expression longer than 100 characters",
    "   ": "empty expression",
}


@pytest.mark.parametrize("expression, error", HOSTILE.items(), ids=[repr(e)[:30] for e in HOSTILE])
def test_a_hostile_call_is_answered_with_a_tool_error_at_once(expression, error):
    """Never an exception out of step and never a hang: a clean ``error: ...`` as the tool's turn, tool_ok False."""
    with pytest.raises(ToolError, match=f"^{re.escape(error)}$"):
        evaluate(expression)
    calculator = Calculator()
    state = calculator.reset("What is 17 + 25?", seed=0)
    start = time.perf_counter()
    step = calculator.step(state, f"<calc>{expression}</calc>", [])
    assert time.perf_counter() - start < 0.05
    assert step == Step(observation=f"error: {error}", info={"tool_call": True, "tool_ok": False})


def test_the_calculator_answers_each_call_then_a_turn_without_one_ends_the_episode():
    calculator = Calculator(max_turns=4)
    assert calculator.init_args == {"max_digits": 30, "max_length": 100, "max_turns": 4}
    assert (calculator.role, calculator.max_turns, calculator.max_observation_tokens) == ("tool", 4, 256)
    state = calculator.reset("What is 46 * 20? ...", seed=3)
    first = calculator.step(state, "Let me compute <calc>46 * 20</calc>.", [])
    assert first == Step(observation="920", reward=None, done=False, info={"tool_call": True, "tool_ok": True})
    two = calculator.step(state, "<calc>46*20</calc> and <calc>1/0</calc>", [])
    assert two == Step(observation="920\nerror: division by zero", info={"tool_call": True, "tool_ok": False})
    cut = calculator.step(state, "<calc>46 * 2", [])  # a turn cut at max_new_tokens inside its call
    assert cut == Step(observation="error: <calc> not closed by </calc>", info={"tool_call": True, "tool_ok": False})
    assert state == {"calls": 4}
    final = calculator.step(state, "920", [])
    assert final == Step(observation=None, reward=None, done=True, info={"tool_call": False, "tool_ok": False})


def test_the_calculator_s_bounds_are_its_arguments_and_are_checked():
    assert evaluate("10 ** 5", max_digits=6) == 100000
    with pytest.raises(ToolError, match="out of range"):
        evaluate("10 ** 6", max_digits=6)
    with pytest.raises(ToolError, match="longer than 5"):
        evaluate("1 + 2 + 3", max_length=5)
    with pytest.raises(ConfigError, match=r"^environment\.max_digits must be an integer in \[1, 300\], got 0$"):
        Calculator(max_digits=0)
    with pytest.raises(ConfigError, match=r"^environment\.max_turns must be an integer >= 1"):
        Calculator(max_turns=0)


def transcript(*turns: str) -> str:
    """An episode's text as the reward backend reads it: its turns decoded, one after the other (the chat
    template's role names left where special tokens were, as SmolLM2's decode shows them)."""
    return "\n".join(turns)


@pytest.mark.parametrize(
    "episode, score",
    [
        (transcript("<calc>46 * 20</calc>", "tool", "920", "assistant", "920"), 1.0),
        (transcript("<calc>46 * 20</calc>", "tool", "920", "assistant", "The answer is 920."), 1.0),
        (transcript("<calc>46 * 20</calc>", "tool", "920", "assistant", "921"), 0.0),  # the final turn is what counts
        (transcript("<calc>46 * 21</calc>", "tool", "966", "assistant", "920"), 1.0),  # a wrong call, the right answer
        (transcript("<calc>46 * 20</calc>"), 0.0),  # ended at max_turns on a call: 20 is its last number
        (transcript("<calc>46 * 20</calc>", "tool", "920", "assistant", "Done."), 1.0),  # no number: the tool's result
    ],
)
def test_exact_answer_scores_the_final_turn_of_a_calculator_episode(episode, score):
    """exact_answer reads the last number of the episode's text: the final turn's, since the calculator ends
    the episode on a turn without a call; a final turn with no number falls back to the tool's last result."""
    prompt = "What is 46 * 20? You may use a calculator: write <calc>the expression</calc> and wait for its result."
    assert ExactAnswerReward().score([prompt], [episode]).tolist() == [score]


def test_the_calculator_prompts_ask_the_question_first():
    """exact_answer computes the answer from the first 'a OP b' of the prompt: the calculator's instructions
    hold no arithmetic, so every shipped calculator prompt's answer is its question's."""
    import json
    from pathlib import Path

    from rlhf_lightning_plugins.rewards.verifiable import question_answer

    for name in ("calculator_train.jsonl", "calculator_validation.jsonl"):
        rows = [json.loads(line) for line in (Path(__file__).parents[1] / "rlhf_lightning" / "prompts" / name).read_text().splitlines()]
        assert len(rows) > 50 and all("<calc>" in row["prompt"] for row in rows)
        assert all(question_answer(row["prompt"]) == row["answer"] for row in rows)


# ---- guess the number ----------------------------------------------------------------------------------------


def test_guess_number_draws_its_secret_from_the_seed_in_the_prompt_s_range():
    game = GuessNumber()
    secrets = [game.reset("I am thinking of a number between 1 and 8.", seed)["secret"] for seed in range(400)]
    assert secrets == [game.reset("I am thinking of a number between 1 and 8.", seed)["secret"] for seed in range(400)]
    assert set(secrets) == set(range(1, 9))
    assert set(game.reset("Guess a number between 20 and 17!", seed)["secret"] for seed in range(200)) == {17, 18, 19, 20}
    assert game.reset("No range here.", 0) | {"secret": None} == {"low": 1, "high": 8, "secret": None, "guesses": 0}


def test_guess_number_answers_higher_or_lower_and_pays_a_right_guess():
    game = GuessNumber(max_turns=3)
    state = game.reset("A number between 1 and 8.", seed=0)
    state["secret"] = 6
    assert game.step(state, "4", []) == Step(observation="Higher than 4.", reward=0.0, done=False, info={"guess": 4})
    assert game.step(state, "My guess is 7", []) == Step(observation="Lower than 7.", reward=0.0, done=False, info={"guess": 7})
    assert game.step(state, "6", []) == Step(observation=None, reward=1.0, done=True, info={"guess": 6})
    state = game.reset("A number between 1 and 8.", seed=0) | {"secret": 2}
    assert game.step(state, "hmm", []).observation == "Reply with one number between 1 and 8."
    assert game.step(state, "5", []) == Step(observation="Lower than 5.", reward=0.0, done=False, info={"guess": 5})
    last = game.step(state, "3", [])  # the third wrong guess: out of guesses
    assert (last.reward, last.done) == (0.0, True)


def play(game: GuessNumber, secret: int, strategy) -> float:
    """The reward one strategy earns against ``secret``: ``strategy(low, high)`` guesses in the range still open."""
    state = game.reset("between 1 and 8", 0) | {"secret": secret}
    low, high, total = 1, 8, 0.0
    for _ in range(game.max_turns):
        guess = strategy(low, high)
        step = game.step(state, str(guess), [])
        total += step.reward or 0.0
        if step.done:
            break
        low, high = (guess + 1, high) if step.observation.startswith("Higher") else (low, guess - 1)
    return total


def test_bisection_wins_seven_of_eight_games_and_blind_guesses_three():
    """The docstring's figures: 1 + 2 + 4 = 7 secrets reachable in three bisecting guesses; three fixed guesses
    find 3 of the 8."""
    game = GuessNumber(max_turns=3)
    bisection = [play(game, secret, lambda low, high: (low + high) // 2) for secret in range(1, 9)]
    assert bisection == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    blind = iter([])

    def fixed(low, high):
        return next(blind)

    wins = 0.0
    for secret in range(1, 9):
        blind = iter([1, 2, 3])
        wins += play(game, secret, fixed)
    assert wins / 8 == 3 / 8


def test_guess_number_checks_its_range():
    with pytest.raises(ConfigError, match=r"^environment\.high must be an integer > environment\.low \(5\), got 5$"):
        GuessNumber(low=5, high=5)


# ---- SkyRL-Gym ---------------------------------------------------------------------------------------------------

QUESTION = "What is 17 + 25? Answer with the number only."
GROUND_TRUTH = "rlhf_lightning_plugins.rewards.verifiable:question_answer"


def test_a_real_skyrl_gym_environment_runs_through_the_adapter():
    """SkyRL-Gym's gsm8k_multi_turn (per-turn rewards: 1 for '#### <answer>', 0.2 / max_turns for the format
    with a wrong number, 0 otherwise; its own feedback as a user turn), its answer from the prompt."""
    pytest.importorskip("skyrl_gym")
    env = registry("environment").get("skyrl_gym")(env_id="gsm8k_multi_turn", ground_truth=GROUND_TRUTH, max_turns=3)
    assert env.role == "user" and env.episode_extras(QUESTION) == {
        "max_turns": 3,
        "extra_info": {},
        "reward_spec": {"ground_truth": "42"},
        "reward_model": {"ground_truth": "42"},
    }
    state = env.reset(QUESTION, seed=0)
    first = env.step(state, "I think it is 41", [])
    assert (first.reward, first.done) == (0.0, False) and "'#### ANSWER'" in first.observation
    second = env.step(state, "#### 41", [])
    assert (second.reward, second.done) == (pytest.approx(0.2 / 3), False)
    assert second.observation == "Now provide only the final numeric answer in the exact format: '#### ANSWER'."
    assert env.step(state, "#### 42", []) == Step(observation=None, reward=1.0, done=True, info={})
    # The episode's turn limit is the environment's own: three wrong turns end it.
    state = env.reset(QUESTION, seed=1)
    assert [env.step(state, "no", []).done for _ in range(3)] == [False, False, True]


def test_the_skyrl_adapter_refuses_an_unknown_id_and_a_prompt_rewriting_environment():
    skyrl_gym = pytest.importorskip("skyrl_gym")
    with pytest.raises(ConfigError, match=r"^environment\.env_id must be a SkyRL-Gym environment \(aime, .*gsm8k_multi_turn.*got 'nope'"):
        registry("environment").get("skyrl_gym")(env_id="nope")
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    class Rewriter(BaseTextEnv):
        def __init__(self, env_config=None, extras=None):
            super().__init__()

        def init(self, prompt):
            return [{"role": "system", "content": "Think."}, *prompt], {}

    skyrl_gym.register(id="rlhf_lightning_test_rewriter", entry_point=Rewriter)
    try:
        env = registry("environment").get("skyrl_gym")(env_id="rlhf_lightning_test_rewriter")
        with pytest.raises(ConfigError, match="rewrites the prompt in init"):
            env.reset(QUESTION, 0)
    finally:
        skyrl_gym.envs.deregister("rlhf_lightning_test_rewriter")


def test_without_skyrl_gym_the_adapter_names_the_pip_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # import skyrl_gym raises ImportError
    with pytest.raises(ConfigError, match=r"^model\.environment skyrl_gym needs the package skyrl-gym: pip install skyrl-gym"):
        registry("environment").get("skyrl_gym")()
