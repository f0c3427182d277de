"""The sampler as a part (rlhf_lightning/sampler.py): what it hands the rollout engine, the rows it assembles, and
the trajectory of exactly the ids drawn, on the tiny model with its character tokenizer."""

from __future__ import annotations

import torch

from rlhf_lightning.interfaces import Samples
from rlhf_lightning.sampler import Drawn

from helpers import make_module


class Recording:
    """A rollout engine that returns fixed responses (with log-probs of its own, -1 each, as an engine with its own
    copy of the weights does) and records what it was handed."""

    def __init__(self, responses: torch.Tensor) -> None:
        self.responses, self.calls = responses, []

    def stale(self, module) -> bool:
        return False

    def checked_sample(self, module, enc, seed) -> Samples:
        self.calls.append((module, seed))
        return Samples(torch.cat([enc["input_ids"], self.responses], dim=1), logprobs=torch.full(self.responses.shape, -1.0))


def test_assemble_pads_after_eos_masks_up_to_it_and_appends_the_response_mask():
    module = make_module()
    sampler, tok = module.sampler, module.tokenizer
    eos, pad = tok.eos_token_id, tok.pad_token_id
    enc = sampler.encode(["ab", "c"])  # left-padded: "c" has one pad in front
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    drawn = torch.tensor([[a, eos, b, b], [b, b, a, a]])  # row 0 ends at its 2nd token; row 1 never
    input_ids, attention_mask, response, mask, ended = sampler.assemble(enc, Samples(torch.cat([enc["input_ids"], drawn], 1)))
    assert response.tolist() == [[a, eos, pad, pad], [b, b, a, a]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert ended.tolist() == [True, False]
    assert torch.equal(input_ids, torch.cat([enc["input_ids"], response], 1))
    assert attention_mask.tolist() == [[*enc["attention_mask"][0].tolist(), 1, 1, 0, 0], [*enc["attention_mask"][1].tolist(), 1, 1, 1, 1]]


def test_the_engine_gets_a_view_at_the_draws_weights_and_seed_and_the_trajectory_scores_the_ids_drawn():
    """The engine is handed a view whose global_step and exploration are the draw's (the sampler itself unchanged),
    the seed base + 7919 rank + 104729 iteration; the trajectory holds the prompt's ids then exactly the drawn ids,
    the version given, and the trainer's log pi_old and log pi_ref of those ids (the reference is the policy at step 0:
    equal), the engine's log-probs kept as the sampler's."""
    module = make_module()
    sampler = module.sampler
    a, b = module.tokenizer.convert_tokens_to_ids(["a", "b"])
    fixed = torch.tensor([[a, b, a], [b, b, b]])
    engine = Recording(fixed)
    sampler.engine = engine
    trajectory = sampler.rollout(["ab", "c"], iteration=5, global_step=7, exploration=0.0)
    ((view, seed),) = engine.calls
    assert view is not sampler and view.global_step == 7 and sampler.global_step == 0
    assert seed == sampler.generation_seed_base + 104729 * 5
    enc = sampler.encode(["ab", "c"])
    assert torch.equal(trajectory.input_ids, torch.cat([enc["input_ids"], fixed], 1))
    assert trajectory.responses.tolist() == fixed.tolist() and trajectory.policy_version.tolist() == [5, 5]
    logits = module.networks.response_logits(module.policy, trajectory.input_ids, trajectory.attention_mask, 3)
    expected = torch.log_softmax(logits, -1).gather(-1, fixed.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(trajectory.trainer_logprobs, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(trajectory.ref_logprobs, trajectory.trainer_logprobs)
    assert trajectory.sampler_logprobs.eq(-1.0).all()  # the engine's own, kept as the behaviour policy's


def test_a_batch_drawn_and_scored_elsewhere_keeps_its_scores_and_version():
    """``trajectory`` of a ``Drawn`` that a sampler scored ahead: its reward, fault and reference log-probs are
    taken as they are (no second reference pass), its version is the one it was drawn from."""
    module = make_module()
    sampler = module.sampler
    drawn = sampler.draw(["ab", "c"], iteration=2, version=1)
    drawn.raw_scores, drawn.ref_logprobs = torch.tensor([0.5, 1.5]), torch.full(drawn.samples.logits.shape[:2], -2.0)
    trajectory = sampler.trajectory(drawn)
    assert trajectory.raw_scores.tolist() == [0.5, 1.5] and trajectory.policy_version.tolist() == [1, 1]
    assert trajectory.ref_logprobs.eq(-2.0).all()
    restored = Drawn.from_state(drawn.state_dict(), torch.device("cpu"))  # a checkpoint's batch in flight
    assert torch.equal(restored.samples.sequences, drawn.samples.sequences) and restored.version == 1
