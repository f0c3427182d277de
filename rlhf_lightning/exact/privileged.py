"""A teacher that sees more, in closed form: the student pi(y|x) reads the prompt, the teacher pi_ref(y|x, a) also
an answer a observed with it (``model.prompts.teacher_template``), a ~ p(a|x) the data's.

The objective, for a reward r and beta > 0:

    J(pi) = E_x [ E_{y~pi} r(x, y) - beta E_{a~p(.|x)} KL(pi(.|x) || pi_ref(.|x, a)) ].

Since E_a KL(pi || t_a) = sum_y pi log pi - sum_y pi E_a log t_a = KL(pi || g) - log Z_g, with

    log g(y|x) = E_a log pi_ref(y|x, a) - log Z_g(x),   Z_g(x) = sum_y exp(E_a log pi_ref(y|x, a)) <= 1

(g the normalised geometric mean of the teachers, weights p(a|x); Z_g <= 1 by the inequality of the weighted
means), J(pi) = E r - beta KL(pi || g) + beta E_x log Z_g: the plain KL-regularised objective with g as the
reference, shifted by a constant. So pi* ∝ g exp(r / beta) and J* = E_x beta (log Z_g + log sum_y g exp(r / beta)).
With a reward of 0, pi* = g: not the teachers' mixture sum_a p(a) t_a (the forward KL's optimum), and the teacher
itself where one answer goes with each prompt (J* = 0).

The teacher as the reference conditioned on the answer (Bayes): pi_ref(y|x, a) = pi_ref(y|x) p(a|x, y) / p_ref(a|x),
p(a|x, y) the likelihood of the answer after the response. Then g ∝ pi_ref(y|x) exp(E_a log p(a|x, y)): at any
beta, distilling from the teacher that sees the answer is the KL-regularised optimum at beta 1 of the reward
E_{a~p} log p(a|x, y) toward the plain reference, the answer's expected log-likelihood after the response.

Shapes: (prompts, responses) log-probs and rewards as closed_form.py's; the teachers (prompts, answers, responses).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_lightning.exact.closed_form import expected_reward, log_partition, optimal_logprobs
from rlhf_lightning.exact.tabular import expected_log_ratio


def conditioned_teachers(ref_logprobs: Tensor, answer_loglik: Tensor) -> Tensor:
    """log pi_ref(y|x, a) = log pi_ref(y|x) + log p(a|x, y) - log p_ref(a|x), p_ref(a|x) = sum_y pi_ref(y|x) p(a|x, y):
    (prompts, responses) and (prompts, responses, answers) -> (prompts, answers, responses)."""
    joint = ref_logprobs.double().unsqueeze(-1) + answer_loglik.double()  # log pi_ref(y|x) p(a|x, y)
    return (joint - joint.logsumexp(1, keepdim=True)).transpose(1, 2)


def geometric_teacher(teacher_logprobs: Tensor, answer_probs: Tensor) -> tuple[Tensor, Tensor]:
    """(log g, log Z_g): the teachers' normalised geometric mean with weights p(a|x), (prompts, responses), and its
    log-normaliser (prompts,); ``teacher_logprobs`` (prompts, answers, responses), ``answer_probs`` (prompts, answers)."""
    mean = (answer_probs.double().unsqueeze(-1) * teacher_logprobs.double()).sum(1)
    log_z = mean.logsumexp(-1)
    return mean - log_z.unsqueeze(-1), log_z


def privileged_objective(logprobs: Tensor, teacher_logprobs: Tensor, answer_probs: Tensor, rewards: Tensor, beta: float) -> float:
    """J(pi) = E_x [E_{y~pi} r - beta E_{a~p(.|x)} KL(pi(.|x) || pi_ref(.|x, a))], summed answer by answer."""
    kls = expected_log_ratio(logprobs.double().unsqueeze(1), teacher_logprobs.double())  # (prompts, answers)
    return expected_reward(logprobs, rewards) - beta * float((answer_probs.double() * kls).sum(-1).mean())


def privileged_optimum(teacher_logprobs: Tensor, answer_probs: Tensor, rewards: Tensor, beta: float) -> tuple[Tensor, float]:
    """(log pi*, J*): pi* ∝ g exp(r / beta), J* = E_x beta (log Z_g + log sum_y g exp(r / beta)) (module docstring)."""
    log_g, log_z = geometric_teacher(teacher_logprobs, answer_probs)
    j_star = beta * float((log_z + log_partition(log_g, rewards, beta)).mean())
    return optimal_logprobs(log_g, rewards, beta), j_star


def privileged_surrogate(logprobs: Tensor, teacher_logprobs: Tensor, answer_probs: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """A scalar whose gradient in ``logprobs`` (whole-response log-probs, (prompts, responses), requiring grad) is the
    loop's policy gradient in expectation: each row draws y ~ pi and carries its prompt's answer a ~ p(a|x), its return
    R = r - beta (log pi(y) - log pi_ref(y|x, a)) (k1 in the reward, the teacher's log-probs of the row's own ids),
    REINFORCE: E_x E_a E_{y~pi} [sg(R) grad log pi(y)], summed exactly. Its gradient is grad J (ascent)."""
    weights = logprobs.detach().exp().unsqueeze(1) * answer_probs.double().unsqueeze(-1)  # pi(y) p(a): (prompts, answers, responses)
    returns = rewards.double().unsqueeze(1) - beta * (logprobs.detach().unsqueeze(1) - teacher_logprobs.double())
    return (weights * returns * logprobs.unsqueeze(1)).sum() / logprobs.shape[0]


def teacher_task(seed: int, prompts: int = 2, responses: int = 27, answers: int = 3) -> dict[str, Tensor]:
    """An enumerable task with an observed answer: pi_ref(y|x) random (logits N(0, 1)), the answer's log-likelihood
    log p(a|x, y) random (logits 2 N(0, 1) over the answers), p(a|x) the reference's own marginal p_ref(a|x) (answers
    drawn as the model would), rewards N(0, 1); the teachers by Bayes (:func:`conditioned_teachers`)."""
    generator = torch.Generator().manual_seed(seed)
    ref = torch.randn(prompts, responses, generator=generator, dtype=torch.float64).log_softmax(-1)
    loglik = (2 * torch.randn(prompts, responses, answers, generator=generator, dtype=torch.float64)).log_softmax(-1)
    answer_probs = (ref.unsqueeze(-1) + loglik).logsumexp(1).exp()  # p_ref(a|x)
    rewards = torch.randn(prompts, responses, generator=generator, dtype=torch.float64)
    teachers = conditioned_teachers(ref, loglik)
    return dict(ref=ref, answer_loglik=loglik, answer_probs=answer_probs, rewards=rewards, teachers=teachers)
