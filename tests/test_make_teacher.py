"""tools/make_teacher.py, on the tiny model: the full stops it swaps, and the teacher it writes, which
``model.reference`` loads and which prefers "!" where its start wrote "." (configs/distill.yaml's teacher is the
same command on SmolLM2: docs/results.md, "Distillation on SmolLM2")."""

from __future__ import annotations

import torch

from rlhf_lightning.models import char_tokenizer

from helpers import make_module


def test_the_exclaiming_map_swaps_every_token_with_a_full_stop_that_has_a_twin():
    from tools import make_teacher

    tokenizer = char_tokenizer()
    vocabulary = tokenizer.get_vocab()
    mapping = make_teacher.exclaiming_map(tokenizer)
    assert mapping == {vocabulary["."]: vocabulary["!"]}
    ids = torch.tensor([[vocabulary["a"], vocabulary["."], vocabulary["!"], vocabulary["."]]])
    assert make_teacher.exclaimed(ids, mapping).tolist() == [[vocabulary["a"], vocabulary["!"], vocabulary["!"], vocabulary["!"]]]


def test_the_teacher_loads_as_the_reference_and_prefers_exclamations(tmp_path):
    """The folder is a ``model.reference`` for its own start (same tokenizer); on the start's own responses the
    teacher's log p("!") - log p(".") at the response's positions is higher than the start's, and the KL it printed
    is KL(start || teacher) > 0 on held-out responses (measured: the preference 2.52 nats above the start's, KL 2.01
    nats per response, 0.81 "!" per response against 0.25). About 25 s."""
    from tools import make_teacher

    out = tmp_path / "teacher"
    argv = ["--policy", "tiny", "--out", str(out), "--prompts", "32", "--held-out", "16", "--lr", "1e-2", "--epochs", "4"]
    printed = make_teacher.main(argv)
    assert printed["kl"] > 0.1 and printed["bangs_teacher"] > printed["bangs_start"], printed
    module = make_module(reference=str(out), sampling=dict(max_new_tokens=24, min_new_tokens=24))
    torch.manual_seed(0)
    rollout = module.rollout(["Hi", "Go", "The", "What is"] * 4)
    vocabulary = module.tokenizer.get_vocab()
    bang, stop = vocabulary["!"], vocabulary["."]
    with torch.no_grad():
        preference = {
            name: (lambda lp: (lp[..., bang] - lp[..., stop])[rollout.response_mask.bool()].mean())(
                torch.log_softmax(module.networks.response_logits(model, rollout.input_ids, rollout.attention_mask, 24), -1)
            )
            for name, model in (("start", module.policy), ("teacher", module.ref_model))
        }
    assert float(preference["teacher"] - preference["start"]) > 0.5, preference
    kl = ((rollout.trainer_logprobs - rollout.ref_logprobs) * rollout.response_mask).sum(-1)
    assert float(kl.mean()) > 0.1  # the reference is the teacher, not the start
