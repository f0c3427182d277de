"""A teacher that sees more (``model.prompts.teacher_template``): the reference scores the student's response ids,
exactly as drawn, after a teacher prompt rendered from each prompt's row of the prompt file; the template's
refusals at start-up; and the lab's closed form (rlhf_lightning/exact/privileged.py) of the optimum when the
teacher conditions on an observed answer."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_lightning.args import PromptArgs
from rlhf_lightning.checks import ConfigError, check_prompt_table
from rlhf_lightning.data import PromptDataModule, PromptTable, prompt_id
from rlhf_lightning_plugins.beta_controllers import FixedBeta

from helpers import CONFIGS, cli, make_module, run_cli

TEMPLATE = "{prompt} so {answer}"
ROWS = [{"prompt": "abc", "answer": "three"}, {"prompt": "hello", "answer": "five"}, {"prompt": "xyz", "answer": "zero"}]


def answer_file(tmp_path, rows=ROWS, name="answers.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def teacher_table(tmp_path, template=TEMPLATE, rows=ROWS) -> PromptTable:
    return PromptDataModule(train_path=str(answer_file(tmp_path, rows))).prompt_table(None, template)


def test_the_prompt_table_renders_each_rows_teacher_prompt(tmp_path):
    table = teacher_table(tmp_path, "{prompt}\nThe answer is {answer}.", [*ROWS, {"prompt": "n", "answer": 7}])
    assert table.teacher_prompts(["xyz", "abc", "xyz", "n"]) == [
        "xyz\nThe answer is zero.",
        "abc\nThe answer is three.",
        "xyz\nThe answer is zero.",
        "n\nThe answer is 7.",  # a number as Python writes it
    ]
    with pytest.raises(
        ConfigError, match=r"the teacher's prompts \(model.prompts.teacher_template\) must be of prompts of data.train_path"
    ):
        table.teacher_prompts(["not in the file"])


def test_the_validation_prompts_have_their_teacher_where_their_file_has_the_columns(tmp_path):
    """PassAtK and the validation loop score held-out prompts with the reference too."""
    train = answer_file(tmp_path, ROWS[:2])
    val = answer_file(tmp_path, ROWS[2:], "val.jsonl")
    table = PromptDataModule(train_path=str(train), val_path=str(val)).prompt_table(None, TEMPLATE)
    assert table.ids == [prompt_id("abc"), prompt_id("hello")] and table.teacher_prompts(["xyz", "abc"]) == ["xyz so zero", "abc so three"]
    plain = PromptDataModule(train_path=str(train)).prompt_table(None, TEMPLATE)  # the built-in validation prompts: no answers
    assert set(plain.teacher) == {"abc", "hello"}


@pytest.mark.parametrize("template", ["{}", "{0}", "{answer.real}", "{answer[0]}", "{prompt", "{prompt}", " "])
def test_a_template_that_is_no_format_string_of_columns_or_adds_nothing_is_refused(template):
    with pytest.raises(ConfigError, match=r"^model\.prompts\.teacher_template must be a format string of \{prompt\}"):
        PromptArgs(teacher_template=template)


def test_a_template_naming_a_missing_or_empty_column_or_two_teachers_for_one_prompt_is_refused(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^model\.prompts\.teacher_template: column 'solution' not found in answers\.jsonl .*available columns: prompt, answer",
    ):
        teacher_table(tmp_path, "{prompt} {solution}")
    with pytest.raises(
        ConfigError, match=r"answers\.jsonl', line 2: column 'answer' is empty, and model\.prompts\.teacher_template names it"
    ):
        teacher_table(tmp_path, rows=[ROWS[0], {"prompt": "hello", "answer": None}])
    with pytest.raises(ConfigError, match=r"line 3: the prompt 'abc' has two teacher prompts .*'abc so three' and 'abc so four'"):
        teacher_table(tmp_path, rows=[*ROWS[:2], {"prompt": "abc", "answer": "four"}])
    with pytest.raises(ConfigError, match=r"cannot be rendered"):
        teacher_table(tmp_path, "{prompt} {answer:d}")


def test_a_template_with_batches_from_no_prompt_file_is_refused():
    with pytest.raises(ConfigError, match=r"^model\.prompts\.teacher_template must be null when the training batches come from no prompt"):
        check_prompt_table(None, FixedBeta(0.1), TEMPLATE, None)
    check_prompt_table(None, FixedBeta(0.1), None, None)


def drawn_with_teacher(module, table, prompts):
    """``prompts`` drawn by the module's sampler, the sampler scoring the reference under ``table``'s teacher prompts."""
    sampler = module.sampler
    sampler.teacher_prompts = table.teacher_prompts
    return sampler, sampler.draw(prompts, 0, 0)


def check_teacher_inputs(module, table, prompts, teacher_ids):
    """The reference's rows are ``teacher_ids(text)`` (the teacher prompt's ids as the template renders them) then
    the student's response ids exactly; log pi_ref of the trajectory and of ``score_drawn`` (the asynchronous
    sampler's) are the reference's by a plain forward of those ids, and differ from the student's own prompt's."""
    sampler, drawn = drawn_with_teacher(module, table, prompts)
    input_ids, attention_mask, response, mask, _ = sampler.assemble(drawn.enc, drawn.samples)
    ids, ids_mask = sampler.reference_inputs(drawn, input_ids, attention_mask, response)
    assert torch.equal(ids[:, -response.shape[1] :], input_ids[:, -response.shape[1] :])  # the response, as drawn
    hand = [teacher_ids(text) + response[i][mask[i].bool()].tolist() for i, text in enumerate(table.teacher_prompts(prompts))]
    assert [ids[i][ids_mask[i].bool()].tolist() for i in range(len(prompts))] == hand
    rollout = sampler.trajectory(drawn)
    with torch.no_grad(), module.networks.reference() as reference:
        for i, row in enumerate(hand):
            n = int(mask[i].sum())
            logits = reference(input_ids=torch.tensor([row])).logits[0, -n - 1 : -1].float() / module.sampling.temperature
            by_hand = logits.log_softmax(-1).gather(-1, response[i, :n, None]).squeeze(-1)
            assert torch.allclose(rollout.ref_logprobs[i, :n], by_hand, atol=1e-4), (rollout.ref_logprobs[i, :n] - by_hand).abs().max()
    sampler.score_drawn(drawn, reference=True)  # the sampler that draws ahead scores the same ids
    assert drawn.ref_logprobs is not None and torch.allclose(drawn.ref_logprobs * mask, rollout.ref_logprobs * mask, atol=1e-5)
    assert float(((rollout.ref_logprobs - rollout.old_logprobs) * mask).abs().max()) > 1e-3  # the teacher is not the student


def test_the_teacher_scores_the_students_response_ids_after_its_own_prompt_on_the_char_model(tmp_path):
    module = make_module()
    table = teacher_table(tmp_path)
    tokenizer = module.tokenizer
    check_teacher_inputs(module, table, ["abc", "hello", "abc", "xyz"], lambda text: tokenizer(text)["input_ids"])


def test_the_teacher_prompt_goes_through_the_chat_template_on_smollm2s_tokenizer(tmp_path):
    module = make_module(tokenizer="smollm2", loading=dict(tiny_config={"hidden_size": 32, "intermediate_size": 64}))
    table = teacher_table(tmp_path, "{prompt}\nThe answer is {answer}.")
    tokenizer = module.tokenizer

    def chat_ids(text):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        assert f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n" in rendered  # the teacher's text as the user's turn
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]

    check_teacher_inputs(module, table, ["abc", "hello", "xyz", "abc"], chat_ids)


def test_without_a_template_the_reference_reads_the_students_rows():
    module = make_module()
    drawn = module.sampler.draw(["abc", "hello"], 0, 0)
    input_ids, attention_mask, response, _, _ = module.sampler.assemble(drawn.enc, drawn.samples)
    ids, ids_mask = module.sampler.reference_inputs(drawn, input_ids, attention_mask, response)
    assert ids is input_ids and ids_mask is attention_mask


def test_the_command_trains_with_a_teacher_that_sees_the_answer_and_refuses_a_missing_column(tmp_path):
    """From a fresh folder, configs/tiny.yaml on a prompt file with an answer column: the run ends, the reference
    scoring each response after "<prompt> so <answer>"; a template naming a column the file lacks exits 2 at start-up,
    before any model loads, naming the field."""
    rows = [{"prompt": p, "answer": a} for p, a in zip("abcdefgh", ["one", "two", "six", "ten"] * 2, strict=True)]
    path = answer_file(tmp_path, rows)
    result = run_cli(tmp_path / "run", f"--data.train_path={path}", f"--model.prompts.teacher_template={TEMPLATE}", "--data.batch_size=4")
    assert result.returncode == 0, result.stderr[-3000:]
    from tools.summarize_run import read_scalars

    kl = list(read_scalars(str(tmp_path / "run" / "lightning_logs" / "tiny" / "version_0"))["objective/kl"].values())
    assert len(kl) == 2 and abs(kl[0]) > 1e-3  # the starting policy under another prompt: a KL from the first iteration (0 without it)
    bad = cli(
        tmp_path / "bad",
        "fit",
        "--config",
        str(CONFIGS / "tiny.yaml"),
        f"--data.train_path={path}",
        "--model.prompts.teacher_template={prompt} {hint}",
        "--data.batch_size=4",
    )
    assert bad.returncode == 2, bad.stderr[-2000:]
    args = (
        "--config",
        str(CONFIGS / "tiny.yaml"),
        f"--data.train_path={path}",
        f"--data.val_path={path}",
        f"--model.prompts.teacher_template={TEMPLATE}",
    )
    validate = cli(tmp_path / "validate", "validate", *args, "--trainer.limit_val_batches=1")  # held-out prompts scored by the teacher too
    assert validate.returncode == 0, validate.stderr[-3000:]
    assert "model.prompts.teacher_template: column 'hint' not found in answers.jsonl" in bad.stderr


# ---------------------------------------------------------------------------------------------- the lab
@pytest.fixture(scope="module")
def task():
    from rlhf_lightning.exact.privileged import teacher_task

    return teacher_task(seed=0)


def test_the_reverse_kl_to_the_teachers_is_the_kl_to_their_geometric_mean_shifted(task):
    """E_a KL(pi || t_a) = KL(pi || g) - log Z_g for any pi, Z_g <= 1: J(pi) = J_g(pi) + beta E_x log Z_g (brute force
    over the answers against closed_form.objective with g as the reference)."""
    from rlhf_lightning.exact.closed_form import objective
    from rlhf_lightning.exact.privileged import geometric_teacher, privileged_objective

    log_g, log_z = geometric_teacher(task["teachers"], task["answer_probs"])
    assert torch.allclose(log_g.exp().sum(-1), torch.ones(2, dtype=torch.float64)) and bool((log_z <= 0).all())
    for seed in range(3):
        pi = torch.randn(2, 27, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).log_softmax(-1)
        for beta in (0.5, 2.0):
            brute = privileged_objective(pi, task["teachers"], task["answer_probs"], task["rewards"], beta)
            assert brute == pytest.approx(objective(pi, log_g, task["rewards"], beta) + beta * float(log_z.mean()), abs=1e-12)


@pytest.mark.parametrize("beta", [0.3, 1.0, 3.0])
def test_the_optimum_is_the_geometric_teacher_tilted_by_the_reward_and_nothing_beats_it(task, beta):
    """J(pi*) = J*, and J(pi) = J* - beta KL(pi || pi*) for random policies (so J* is the maximum)."""
    from rlhf_lightning.exact.closed_form import kl_divergence
    from rlhf_lightning.exact.privileged import privileged_objective, privileged_optimum

    teachers, probs, rewards = task["teachers"], task["answer_probs"], task["rewards"]
    log_opt, j_star = privileged_optimum(teachers, probs, rewards, beta)
    assert privileged_objective(log_opt, teachers, probs, rewards, beta) == pytest.approx(j_star, abs=1e-12)
    for seed in range(3):
        pi = torch.randn(2, 27, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).log_softmax(-1)
        j = privileged_objective(pi, teachers, probs, rewards, beta)
        assert j == pytest.approx(j_star - beta * kl_divergence(pi, log_opt), abs=1e-12) and j < j_star


def test_with_reward_0_the_student_learns_the_answers_log_likelihood_as_a_reward_not_the_teachers_mixture(task):
    """Reward 0: pi* = g, which is pi_ref tilted by exp(E_a log p(a|x, y)) (the KL-regularised optimum of that reward
    at beta 1, whatever beta), not the mixture sum_a p(a) t_a (= pi_ref itself when p(a|x) is pi_ref's marginal); with
    one answer per prompt, pi* is that answer's teacher and J* = 0."""
    from rlhf_lightning.exact.closed_form import kl_divergence, optimal_logprobs
    from rlhf_lightning.exact.privileged import privileged_optimum

    teachers, probs, zero = task["teachers"], task["answer_probs"], torch.zeros(2, 27, dtype=torch.float64)
    implicit = (probs.unsqueeze(1) * task["answer_loglik"]).sum(-1)  # E_a log p(a|x, y): (prompts, responses)
    for beta in (0.1, 1.0, 10.0):
        log_opt, _ = privileged_optimum(teachers, probs, zero, beta)
        assert torch.allclose(log_opt, optimal_logprobs(task["ref"], implicit, 1.0), atol=1e-12)
    mixture = (probs.unsqueeze(-1) * teachers.exp()).sum(1).log()
    assert torch.allclose(mixture, task["ref"], atol=1e-12)  # the answers' marginal: the mixture is the plain reference
    assert kl_divergence(log_opt, mixture) > 0.05
    one = torch.nn.functional.one_hot(torch.tensor([2, 0]), 3).double()
    log_opt, j_star = privileged_optimum(teachers, one, zero, 1.0)
    assert torch.allclose(log_opt, teachers[torch.arange(2), torch.tensor([2, 0])], atol=1e-12) and j_star == pytest.approx(0, abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_the_loops_gradient_in_expectation_reaches_the_optimum(task, beta):
    """Ascent on the exact expectation of the loop's estimator (each row's own answer, k1 against that answer's
    teacher in the return, REINFORCE), from pi_ref: KL(pi || pi*) < 1e-6 and J within 1e-6 of J* (reward 0 and beta 1;
    ``beta`` here is the reward's scale, the KL's coefficient is 1)."""
    from rlhf_lightning.exact.closed_form import kl_divergence
    from rlhf_lightning.exact.privileged import privileged_objective, privileged_optimum, privileged_surrogate

    teachers, probs, rewards = task["teachers"], task["answer_probs"], beta * task["rewards"]
    log_opt, j_star = privileged_optimum(teachers, probs, rewards, 1.0)
    logits = task["ref"].clone().requires_grad_()
    optimizer = torch.optim.Adam([logits], lr=0.05)
    for _ in range(1500):
        optimizer.zero_grad()
        (-privileged_surrogate(logits.log_softmax(-1), teachers, probs, rewards, 1.0)).backward()
        optimizer.step()
    pi = logits.detach().log_softmax(-1)
    assert kl_divergence(pi, log_opt) < 1e-6
    assert privileged_objective(pi, teachers, probs, rewards, 1.0) == pytest.approx(j_star, abs=1e-6)
