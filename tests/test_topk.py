"""Truncated-support (top-k) KL estimators (plugins/kl_estimators.TopKKL, docs/divergences.md, "Truncated support:
top-k"): each by hand on a 3-token vocabulary, their classes (recipes.truncation_recipe) and start-up warning, and the
lab's table (rlhf_lightning.exact.truncated): the start-of-training columns in the fast tier, where training lands in
the convergence tier."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning import recipes
from rlhf_lightning.registry import registry


def create(name: str, **init_args):
    return registry("kl_estimator").create(name, **init_args)


def kl(name: str, student, teacher, **init_args) -> torch.Tensor:
    """The estimator's value at one position with student pi = ``student`` and teacher pi_ref = ``teacher`` (probabilities)."""
    logits, ref_logits = (torch.tensor(x, dtype=torch.float64).log().view(1, 1, -1) for x in (student, teacher))
    return create(name, **init_args)(logits[..., 0], ref_logits[..., 0], logits, ref_logits)


# Student p = (0.5, 0.3, 0.2), teacher q = (0.2, 0.7, 0.1). Teacher's top 1: {1}, top 2: {1, 0}; student's top 1:
# {0}, top 2: {0, 1}. The terms (natural logs):
#   q log(q/p):  token 1: 0.7 log(0.7/0.3) = 0.593109   token 0: 0.2 log(0.2/0.5) = -0.183258   token 2: 0.1 log(0.1/0.2) = -0.069315
#   p log(p/q):  token 0: 0.5 log(0.5/0.2) = 0.458145   token 1: 0.3 log(0.3/0.7) = -0.254189   token 2: 0.2 log(0.2/0.1) = 0.138629
# forward KL(q || p) = 0.593109 - 0.183258 - 0.069315 = 0.340536; reverse KL(p || q) = 0.458145 - 0.254189 + 0.138629 = 0.342585.
P, Q = (0.5, 0.3, 0.2), (0.2, 0.7, 0.1)
HAND = [
    ("topk_forward", 1, 0.593109),  # q1 log(q1/p1)
    ("topk_forward", 2, 0.593109 - 0.183258),  # = 0.409851
    ("topk_forward_clamped", 2, 0.409851),  # positive: the clamp does nothing
    # tail at k = 1: q_tail = 0.3, p_tail = 0.7: 0.3 log(0.3/0.7) = -0.254189
    ("topk_forward_tail", 1, 0.593109 - 0.254189),  # = 0.338919 <= 0.340536 (a coarsening's KL is a lower bound)
    # tail at k = 2 = V - 1: the tail is token 2 alone, the full forward KL
    ("topk_forward_tail", 2, 0.340536),
    ("topk_reverse", 1, 0.0),  # one token renormalised is 1 for both: log 1 = 0
    # on {0, 1}: p~ = (0.625, 0.375), q~ = (0.2/0.9, 0.7/0.9): 0.625 log(2.8125) + 0.375 log(0.482143) = 0.646296 - 0.273570
    ("topk_reverse", 2, 0.372727),
    ("topk_reverse_unnormalised", 1, 0.458145),
    ("topk_reverse_unnormalised", 2, 0.458145 - 0.254189),  # = 0.203956
    ("topk_generalised", 1, 0.458145 - 0.5 + 0.2),  # p log(p/q) - p + q on {0}: 0.158145
    ("topk_generalised", 2, 0.203956 - 0.8 + 0.9),  # = 0.303956
    ("topk_generalised", 3, 0.342585),  # all of the vocabulary: the masses sum to 1 each, the reverse KL
    ("topk_reverse", 3, 0.342585),
    ("topk_forward", 3, 0.340536),
]


@pytest.mark.parametrize("name, k, expected", HAND)
def test_by_hand_on_three_tokens(name, k, expected):
    assert kl(name, P, Q, k=k).item() == pytest.approx(expected, abs=2e-6)


def test_the_clamp_at_zero_zeroes_the_value_and_the_gradient():
    # Student (0.6, 0.3, 0.1), teacher (0.7, 0.1, 0.2): the student's top 1 is token 0, 0.6 log(0.6/0.7) = -0.092490
    # (verl#7806's review: a negative truncated reverse KL, clamped to 0 with no gradient, while the full KL is 0.5).
    # Swapped (teacher (0.6, 0.3, 0.1)), the teacher's top 1 gives the same -0.092490 for the forward sum (verl#7856).
    for name, student, teacher in (("reverse", (0.6, 0.3, 0.1), (0.7, 0.1, 0.2)), ("forward", (0.7, 0.1, 0.2), (0.6, 0.3, 0.1))):
        assert kl(f"topk_{name}_clamped", student, teacher, k=1).item() == 0.0
        plain = "topk_reverse_unnormalised" if name == "reverse" else "topk_forward"
        assert kl(plain, student, teacher, k=1).item() == pytest.approx(-0.092490, abs=2e-6)
        logits = torch.tensor(student, dtype=torch.float64).log().view(1, 1, -1).requires_grad_()
        ref_logits = torch.tensor(teacher, dtype=torch.float64).log().view(1, 1, -1)
        create(f"topk_{name}_clamped", k=1)(logits[..., 0], ref_logits[..., 0], logits, ref_logits).sum().backward()
        assert not logits.grad.any()


def gradient(name: str, student, teacher, **init_args) -> torch.Tensor:
    logits = torch.tensor(student, dtype=torch.float64).log().view(1, 1, -1).requires_grad_()
    ref_logits = torch.tensor(teacher, dtype=torch.float64).log().view(1, 1, -1)
    create(name, **init_args)(logits[..., 0], ref_logits[..., 0], logits, ref_logits).sum().backward()
    return logits.grad.view(-1)


def test_gradients_by_hand():
    # Teacher's top 1 forward: -q1 log p1 + const; d/dz_b = -q1 (1[b = 1] - p_b) = -0.7 ((0, 1, 0) - (0.5, 0.3, 0.2)).
    torch.testing.assert_close(gradient("topk_forward", P, Q, k=1), torch.tensor([0.35, -0.49, 0.14], dtype=torch.float64))
    # Renormalised on one token: identically 0, so is its gradient.
    assert not gradient("topk_reverse", P, Q, k=1).any()
    # Renormalised on the student's top k: invariant to a shift of the kept logits, blind to the rest's.
    grad = gradient("topk_reverse", P, Q, k=2)
    assert grad[2].abs() < 1e-12 and grad[:2].sum().abs() < 1e-12, grad
    # With the tail at k = V - 1, the full forward KL's gradient: d/dz KL(q || p) = p - q.
    torch.testing.assert_close(
        gradient("topk_forward_tail", P, Q, k=2), torch.tensor(P, dtype=torch.float64) - torch.tensor(Q, dtype=torch.float64)
    )


def test_the_classes_and_the_start_up_warning():
    classes = {name: recipes.truncation_recipe(create(name))[0] for name in registry("kl_estimator").names() if name.startswith("topk")}
    assert classes == {
        "topk": "biased",
        "topk_forward": "biased",
        "topk_forward_clamped": "biased",
        "topk_forward_tail": "approximate",
        "topk_reverse": "approximate",
        "topk_reverse_clamped": "biased",
        "topk_reverse_unnormalised": "biased",
        "topk_generalised": "approximate",
    }
    assert recipes.truncation_recipe(create("topk_reverse", k=1))[0] == "biased"
    assert recipes.truncation_recipe(create("full")) == ("exact", "")
    warning = recipes.truncation_warning(create("topk_forward_clamped", k=8))
    assert warning.startswith("model.kl_estimator TopKKL (top 8 of the teacher) is biased against KL(pi_ref || pi), the forward KL")
    assert "no gradient" in warning and recipes.truncation_warning(create("full")) is None
    # Every top-k estimator's recipe leaves pi* (the reverse KL's optimum) in every placement: the lab's trackers compute none.
    for name in classes:
        for placement in ("reward", "loss", "both"):
            assert recipes.kl_recipe(create(name), placement, "importance")[0] == "biased"


def test_bad_arguments_are_refused():
    from rlhf_lightning.checks import ConfigError

    for init_args in ({"k": 0}, {"of": "both"}, {"renormalise": True, "tail": True}, {"tail": True, "generalised": True}):
        with pytest.raises(ConfigError):
            create("topk", **init_args)
    with pytest.raises(ValueError, match="needs the logits"):
        create("topk_forward")(torch.zeros(1, 1), torch.zeros(1, 1))
