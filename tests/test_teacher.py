"""The closed-form lab with a teacher as the reference (``teacher:SEED``, ``random-teacher:SEED``): a second
seeded network, not the starting policy, is pi_ref. With a reward of 0 the KL-regularised optimum is the
teacher itself (on-policy distillation, the reverse KL KL(pi || pi_teacher) minimised on the policy's own
samples), and so is the per-token fixed point; with a reward, pi* ∝ pi_teacher exp(r / beta). The fast tests
check the numbers against brute force (the teacher's log-probs one prefix at a time, sums over every
response); the convergence tier trains the unchanged PPORLHF loop and lands within 0.02 of them."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlhf_lightning.checks import ConfigError
from rlhf_lightning.exact.closed_form import backward_induction, kl_divergence, objective, optimal_logprobs, optimum_report
from rlhf_lightning.exact.tasks import TEACHER_SEED_OFFSET, ExactPPORLHF, task_named
from rlhf_lightning.exact.training import train
from rlhf_lightning_plugins.advantage_estimators import GAE
from rlhf_lightning_plugins.beta_controllers import FixedBeta

pytestmark = pytest.mark.filterwarnings("ignore:.*eval mode.*", "ignore:.*val_dataloader.*", "ignore:.*LeafSpec.*")

BETA = 1.0  # the random tasks' beta (tools/studies/optimum_check/recipes.py, TASK_SETTINGS)


@torch.no_grad()
def brute_force_logprobs(module: ExactPPORLHF, model) -> torch.Tensor:
    """log p(y|x) of ``model`` for every prompt and response of the module's task, one forward per prefix:
    sum_t log softmax(model(x + y_<t))[y_t], (prompts, responses), float64."""
    task, tokenizer = module.task, module.tokenizer
    out = torch.zeros(len(task.prompts), len(task.responses), dtype=torch.float64)
    for i, prompt in enumerate(task.prompts):
        prompt_ids = module.sampler.encode([prompt])["input_ids"][0].tolist()
        for j, response in enumerate(task.responses):
            ids = tokenizer.convert_tokens_to_ids(list(response))
            for t, token in enumerate(ids):
                logits = model(input_ids=torch.tensor([prompt_ids + ids[:t]])).logits[0, -1].double()
                out[i, j] += logits.log_softmax(-1)[token]
    return out


def test_a_teacher_task_names_its_teacher_and_its_reward():
    distil, rewarded = task_named("teacher:1"), task_named("random-teacher:1")
    assert distil.teacher_seed == rewarded.teacher_seed == 1 + TEACHER_SEED_OFFSET and distil.model_seed == 1
    assert not distil.rewards().any()
    assert torch.equal(rewarded.rewards() != 0, task_named("random:1").rewards() != 0)  # random:1's reward, centred anew
    with pytest.raises(ConfigError, match=r"a random task must be teacher:SEED with SEED a non-negative integer"):
        task_named("teacher:x")
    with pytest.raises(ConfigError, match=r"ExactPPORLHF's arguments must be free of what the task sets itself, got \['reference'\]"):
        ExactPPORLHF(distil, reference="/some/folder")


def test_the_teachers_log_probs_by_brute_force_and_the_student_starts_elsewhere():
    """The reference of ``teacher:1`` is the task's network initialised from the teacher's seed: its exact
    log-probs (one batched forward) equal those of that network built on its own, one prefix at a time; the
    policy is random:1's starting network, 2.6 nats of KL from it."""
    task = task_named("teacher:1")
    module = ExactPPORLHF(task)
    module.configure_model()
    alone = ExactPPORLHF(dataclasses.replace(task, model_seed=task.teacher_seed, teacher_seed=None))
    alone.configure_model()
    torch.testing.assert_close(module.exact_ref_logprobs(), brute_force_logprobs(alone, alone.policy), atol=1e-5, rtol=0)
    torch.testing.assert_close(module.exact_logprobs(), brute_force_logprobs(module, module.policy), atol=1e-5, rtol=0)
    start, teacher = module.exact_logprobs(), module.exact_ref_logprobs()
    brute_kl = sum(
        float(p.exp() * (p - q)) for row, ref_row in zip(start, teacher, strict=True) for p, q in zip(row, ref_row, strict=True)
    ) / len(task.prompts)
    assert kl_divergence(start, teacher) == pytest.approx(brute_kl, abs=1e-9)
    assert kl_divergence(start, teacher) == pytest.approx(2.594, abs=1e-3)


def test_with_a_reward_of_0_the_optimum_and_the_per_token_fixed_point_are_the_teacher():
    """Reward 0: pi* = pi_teacher exp(0) / Z = pi_teacher, J* = 0 and J(pi) = -beta KL(pi || pi_teacher), so the gap is
    undefined (NaN) and the distance is that KL in nats; the per-token fixed point (backward induction without the
    KL still to come) is the teacher too: at the teacher every per-token KL is 0, and Q = 0 leaves
    pi(a | s) ∝ pi_teacher(a | s)."""
    task = task_named("teacher:1")
    module = ExactPPORLHF(task)
    module.configure_model()
    teacher, start, rewards = module.exact_ref_logprobs(), module.exact_logprobs(), task.rewards()
    for soft in (True, False):
        torch.testing.assert_close(backward_induction(teacher, rewards, BETA, task.num_symbols, soft=soft), teacher, atol=1e-6, rtol=0)
    torch.testing.assert_close(optimal_logprobs(teacher, rewards, BETA), teacher, atol=1e-6, rtol=0)
    report = optimum_report(start, teacher, rewards, BETA, task.num_symbols)
    assert math.isnan(report.gap) and abs(report.optimum) < 1e-6
    assert report.objective == pytest.approx(-BETA * kl_divergence(start, teacher), abs=1e-9)
    assert report.kl_to_optimum == pytest.approx(report.kl_to_ref, abs=1e-6)
    assert report.fixed_point_distance == pytest.approx(report.kl_to_ref, abs=1e-6)  # in nats, as kl_to_optimum


@pytest.mark.parametrize("spec", ["forward_kl", "js", "chi2", "alpha:0.5"])
def test_with_a_reward_of_0_every_divergence_optimum_is_the_teacher(spec):
    """Reward 0: r - beta f'(u) = lambda for every response gives u = 1 (f' is increasing), so pi*_f = pi_teacher for
    every f-divergence, J*_f = 0 and, as for the KL, the gap is NaN and the distance KL(pi || pi_teacher) in nats."""
    from rlhf_lightning.exact.f_divergence import divergence_named, divergence_optimal_logprobs

    task = task_named("teacher:1")
    module = ExactPPORLHF(task)
    module.configure_model()
    teacher, start, rewards = module.exact_ref_logprobs(), module.exact_logprobs(), task.rewards()
    divergence = divergence_named(spec)
    torch.testing.assert_close(divergence_optimal_logprobs(teacher, rewards, BETA, divergence), teacher, atol=1e-6, rtol=0)
    report = optimum_report(start, teacher, rewards, BETA, divergence=divergence)
    assert math.isnan(report.gap) and abs(report.optimum) < 1e-6
    assert report.kl_to_optimum == pytest.approx(report.kl_to_ref, abs=1e-6)


def test_with_a_reward_the_optimum_tilts_the_teacher_by_brute_force():
    """random-teacher:1: pi*(y|x) = pi_teacher(y|x) exp(r / beta) / Z(x), summed response by response; J(pi_teacher)
    = 0 (the reward centred under the teacher); J(pi) = J* - beta KL(pi || pi*) at the student's start; and the
    per-token fixed point lies away from pi* (the KL still to come depends on the token chosen)."""
    task = task_named("random-teacher:1")
    module = ExactPPORLHF(task)
    module.configure_model()
    teacher, start, rewards = module.exact_ref_logprobs(), module.exact_logprobs(), task.rewards()
    optimum = optimal_logprobs(teacher, rewards, BETA)
    for i in range(len(task.prompts)):
        weights = [math.exp(float(q) + float(r) / BETA) for q, r in zip(teacher[i], rewards[i], strict=True)]
        brute = [math.log(w / sum(weights)) for w in weights]
        torch.testing.assert_close(optimum[i], torch.tensor(brute, dtype=torch.float64), atol=1e-9, rtol=0)
    assert objective(teacher, teacher, rewards, BETA) == pytest.approx(0.0, abs=1e-6)
    report = optimum_report(start, teacher, rewards, BETA, task.num_symbols)
    # to 1e-6: the float32 network's log-probs sum to 1 within a few 1e-8
    assert report.objective == pytest.approx(report.optimum - BETA * report.kl_to_optimum, abs=1e-6)
    assert report.gap > 1  # the student starts further from pi* than the teacher, whose gap is 1
    fixed_point = backward_induction(teacher, rewards, BETA, task.num_symbols, soft=False)
    assert optimum_report(fixed_point, teacher, rewards, BETA).gap > 0.02


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--matrix", "--task", "teacher:1"], "--matrix: not with teacher:1 (a reward of 0: J* = 0 and the gap the matrix compares is NaN"),
        (["--matrix", "--tabular", "--task", "random-teacher:1"], "--tabular: not with a teacher task"),
        (["--task", "teacher:x"], "'teacher:x' is not one of ['bandit', 'terminal', 'terminal-eos'], random:SEED,"),
    ],
)
def test_optimum_check_refuses_what_a_teacher_task_cannot_give(argv, message, capsys):
    from tools.studies import optimum_check

    with pytest.raises(SystemExit) as stop:
        optimum_check.parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


SETTINGS = dict(  # the random tasks' settings for a gae cell (tools/studies/optimum_check/recipes.py, TASK_SETTINGS)
    batch_size=384,
    lr=2e-3,
    critic_lr=2e-3,
    lr_final=0.1,
    ppo_epochs=4,
    num_minibatches=2,
    vf_coef=0.5,
    advantage_estimator=GAE(lam=1.0),
    beta_controller=FixedBeta(BETA),
    log_samples_every_n_steps=0,
)


@pytest.mark.convergence
def test_distillation_with_a_reward_of_0_converges_to_the_teacher():
    """teacher:1, k1 in the reward, reward 0: PPO minimises KL(pi || pi_teacher) on the student's own samples and
    ends within 0.02 nats of the teacher, from 2.6."""
    _, tracker = train(task_named("teacher:1"), 150, every=150, kl_estimator="k1", **SETTINGS)
    first, last = tracker.rows[0], tracker.last
    print(f"KL(pi || pi_teacher): {first['kl_to_ref']:.4f} -> {last['kl_to_ref']:.4f}")
    assert first["kl_to_ref"] > 2.5 and last["kl_to_ref"] <= 0.02


@pytest.mark.convergence
def test_a_reward_and_a_teacher_converge_to_the_teacher_tilted_by_the_reward():
    """random-teacher:1, k3 in the loss (importance-weighted, the sequence scope): PPO lands within a gap of 0.02
    of pi* ∝ pi_teacher exp(r / beta), not of the optimum against the student's own start."""
    _, tracker = train(task_named("random-teacher:1"), 150, every=150, kl_estimator="k3", kl_penalty="loss", **SETTINGS)
    print(f"gap: {tracker.rows[0]['gap']:.4f} -> {tracker.last['gap']:.4f}")
    assert tracker.last["gap"] <= 0.02
