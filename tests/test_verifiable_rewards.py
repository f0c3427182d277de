"""The exact-answer reward (answers parsed from free text, the question's answer computed from the
prompt), the unbiased pass@k and its callback, and the arithmetic prompt generator."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rlhf_lightning.callbacks import PassAtK, pass_at_k
from rlhf_lightning.data import PromptDataModule
from rlhf_lightning.interfaces import ConfigError
from rlhf_lightning_plugins.rewards.verifiable import ExactAnswerReward, parse_answer, question_answer
from tools import make_arithmetic_prompts

from helpers import fit, make_module


@pytest.mark.parametrize(
    "response, answer",
    [
        ("42", 42),
        ("42.", 42),
        ("17 + 25 = 42", 42),  # the last number, not the question's operands
        ("The sum of 17 and 25 is 42!", 42),
        ("The answer is 42. Check: 40 + 2", 42),  # a stated answer beats later numbers
        ("Answer: -12, since 3 - 15", -12),
        ("\\boxed{1,234} (approximately 1200)", 1234),  # thousands separators
        ("It is -7", -7),
        ("20-13", 13),  # a minus between numbers is an operator, not a sign
        ("42.0", 42),
        ("about 42.5", None),  # not a whole number
        ("forty-two", None),  # numbers in words are not read
        ("", None),
    ],
)
def test_parse_answer(response, answer):
    assert parse_answer(response) == answer


@pytest.mark.parametrize(
    "prompt, answer",
    [
        ("What is 17 + 25? Answer with the number only.", 42),
        ("What is 6 - 19?", -13),
        ("What is 7 * 6?", 42),
        ("What is 3 x 4?", 12),
        ("Compute 12 × -3.", -36),
    ],
)
def test_question_answer_is_computed_from_the_prompt(prompt, answer):
    assert question_answer(prompt) == answer


def test_exact_answer_scores_one_for_the_right_integer_and_wrong_score_otherwise():
    prompts = ["What is 2 + 3?", "What is 2 + 3?", "What is 10 - 14?", "What is 6 * 7?"]
    responses = ["2 + 3 = 5", "6", "-4", "I don't know"]
    torch.testing.assert_close(ExactAnswerReward().checked_scores(prompts, responses), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(ExactAnswerReward(wrong_score=-0.5).checked_scores(prompts, responses), torch.tensor([1.0, -0.5, 1.0, -0.5]))


def test_a_prompt_without_a_question_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"exact_answer must be an arithmetic question .*got 'Write a poem.'"):
        ExactAnswerReward().checked_scores(["Write a poem."], ["5"])
    with pytest.raises(ConfigError, match=r"reward_model.wrong_score must be a finite number < 1, got 2"):
        ExactAnswerReward(wrong_score=2)


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 0, 1, 0.0),
        (4, 1, 1, 0.25),  # pass@1 = c / n
        (4, 1, 4, 1.0),  # all 4 drawn: the one correct is among them
        (4, 2, 2, 1 - 1 / 6),  # 1 - C(2, 2) / C(4, 2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7, 5) / C(10, 5)
        (4, 4, 1, 1.0),
    ],
)
def test_pass_at_k_matches_its_closed_form(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_k_above_the_samples():
    with pytest.raises(ConfigError, match=r"PassAtK.ks must be integers in \[1, n\] \(n = 4 samples\), got 5"):
        pass_at_k(4, 1, 5)


def test_pass_at_k_callback_samples_max_k_answers_per_question_and_averages_over_questions():
    # Question 1 is answered right in 1 of its 4 samples, question 2 in 3 of 4:
    # pass@1 = (1/4 + 3/4) / 2 = 0.5, pass@2 = ((1 - 3/6) + 1) / 2 = 0.75, pass@4 = 1.
    answers = {"What is 1 + 1?": ["2", "3", "4", "5"], "What is 2 + 2?": ["4", "4", "1", "4"]}
    logged = {}
    module = SimpleNamespace(
        rollout=lambda prompts: SimpleNamespace(prompts=prompts, response_texts=[answers[p][i % 4] for i, p in enumerate(prompts)]),
        reward_model=ExactAnswerReward(),
        log_dict=lambda metrics, **kwargs: logged.update(metrics),
    )
    PassAtK(ks=[1, 2, 4]).on_validation_batch_end(SimpleNamespace(sanity_checking=False), module, None, list(answers), 0)
    assert logged == pytest.approx({"val/pass@1": 0.5, "val/pass@2": 0.75, "val/pass@4": 1.0})


def test_pass_at_k_is_logged_in_a_fit_with_the_exact_answer_reward(tmp_path):
    train, val = make_arithmetic_prompts.main(["--out-dir", str(tmp_path), "--train", "8", "--val", "4"])
    data = PromptDataModule(train_path=str(train), val_path=str(val), batch_size=4, val_batch_size=4)
    module = make_module(reward_model=ExactAnswerReward(), sampling=dict(max_new_tokens=4))
    trainer, _ = fit(module, tmp_path, iterations=1, datamodule=data, callbacks=[PassAtK(ks=[1, 2])], limit_val_batches=1)
    metrics = trainer.callback_metrics
    # The random tiny model writes characters, not sums: every sample is wrong.
    assert metrics["val/pass@1"] == metrics["val/pass@2"] == metrics["val/reward"] == 0.0


def test_generated_questions_are_distinct_and_held_out_ones_are_not_in_training(tmp_path):
    train_path, val_path = make_arithmetic_prompts.main(
        ["--out-dir", str(tmp_path), "--train", "300", "--val", "38", "--max-operand", "12"]
    )
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    val = [json.loads(line) for line in val_path.read_text().splitlines()]
    prompts = [row["prompt"] for row in train + val]
    assert (len(train), len(val)) == (300, 38) and len(set(prompts)) == 338  # every question there is
    # The stored answer is the one the reward computes, and the operands stay in [0, 12].
    assert all(row["answer"] == question_answer(row["prompt"]) and abs(row["answer"]) <= 24 for row in train + val)
    with pytest.raises(ValueError, match="only 338"):  # 13 * 13 pairs, two operations
        make_arithmetic_prompts.arithmetic_questions(300, 39, 12, ["+", "-"], 0)
