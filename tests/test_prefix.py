"""Rows that share a prompt share its forward pass (rlhf_lightning/prefix.py): the same logits, hidden
states and gradients as a plain forward, to fp32 rounding, with and without LoRA."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning import prefix

from helpers import fit, make_module

PROMPTS = ["a much longer prompt than the other two", "short", "tiny"]


def group_batch(module, rows_of=(0, 1, 0, 2, 1, 0), response_len=4, system=""):
    """Rows of prompt + response: prompts ``system + PROMPTS[i]`` for i in ``rows_of`` (left-padded to the
    longest), each with its own random response; the last row's response ends early (its last two positions masked)."""
    enc = module.sampler.encode([system + PROMPTS[i] for i in rows_of])
    response = torch.randint(5, 60, (len(rows_of), response_len), generator=torch.Generator().manual_seed(3))
    response_mask = torch.ones_like(response)
    response_mask[-1, -2:] = 0
    return torch.cat([enc["input_ids"], response], 1), torch.cat([enc["attention_mask"], response_mask], 1), response_len


def test_distinct_prompts_finds_each_prompts_first_row_and_every_rows_prompt():
    ids = torch.tensor([[0, 5, 6, 1], [7, 5, 6, 2], [0, 5, 6, 3], [0, 0, 9, 4]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]])
    first, inverse = prefix.distinct_prompts(ids, mask, prompt_len=3)
    # rows 0 and 2 share "_ 5 6" (the pad's id does not matter: row 3's pad 0 against row 1's real 7)
    assert sorted(first.tolist()) == [0, 1, 3]
    assert torch.equal(first[inverse], torch.tensor([0, 1, 0, 3]))
    assert prefix.distinct_prompts(ids[:2], mask[:2], prompt_len=3) is None  # nothing shared: the plain forward


@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("advantage, critic", [("rloo", None), ("gae", "shared")])
@pytest.mark.parametrize("system", ["", "You are a kind assistant. "])
def test_shared_prompt_forward_gives_the_plain_forwards_logits_hidden_states_and_gradients(lora_rank, advantage, critic, system):
    """With a system prompt the distinct prompts' common beginning runs once too (prefix._prompts_once)."""
    module = make_module(
        lora=dict(rank=lora_rank),
        sampling=dict(num_generations=2),
        optim=dict(critic_lr=None),
        advantage_estimator=advantage,
        critic=critic,
    )
    ids, mask, response_len = group_batch(module, system=system)
    weights = torch.randn(ids.shape[0], response_len, len(module.tokenizer), generator=torch.Generator().manual_seed(0))

    def outputs(shared: bool):
        module.networks.shared_prompts = shared
        module.policy.zero_grad(set_to_none=True)
        logits, values = module.networks.policy_outputs(ids, mask, response_len)
        loss = (weights[..., : logits.shape[-1]] * logits).sum() + (0 if values is None else values.sum())
        loss.backward()
        grads = {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}
        return logits.detach(), None if values is None else values.detach(), grads

    shared_logits, shared_values, shared_grads = outputs(True)
    plain_logits, plain_values, plain_grads = outputs(False)
    assert shared_logits.shape == (ids.shape[0], response_len, plain_logits.shape[-1])
    torch.testing.assert_close(shared_logits, plain_logits, rtol=0, atol=2e-5)
    if critic is not None:  # the value head reads the hidden states
        torch.testing.assert_close(shared_values, plain_values, rtol=0, atol=2e-5)
    assert shared_grads.keys() == plain_grads.keys() and len(plain_grads) > 0
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=2e-5, msg=name)


def test_shared_prompts_run_the_prompt_tokens_once_per_distinct_prompt():
    """The saving itself: the trunk's first layer sees each distinct prompt's tokens once (3 prompts here),
    then every row's response; the plain forward sees every row's prompt and response."""
    module = make_module()
    ids, mask, response_len = group_batch(module)
    seen = []
    hook = module.policy.model.layers[0].register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[:2]))
    try:
        with torch.no_grad():
            for shared in (True, False):
                module.networks.shared_prompts = shared
                module.networks.response_logits(module.policy, ids, mask, response_len)
    finally:
        hook.remove()
    prompt_len = ids.shape[1] - response_len
    assert seen == [(3, prompt_len), (6, response_len - 1), (6, ids.shape[1])]


SYSTEM = "You are a kind assistant. "  # the beginning every prompt shares, as a chat template's system prompt


def test_common_prefix_counts_the_first_real_tokens_all_prompts_share():
    ids = torch.tensor([[0, 0, 5, 6, 7, 1], [5, 6, 7, 8, 9, 2], [0, 5, 6, 8, 9, 3]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    # Prompts (5 columns) "5 6 7", "5 6 7 8 9", "5 6 8 9": "5 6" in common; the shortest keeps its last token.
    assert prefix.common_prefix(ids, mask, prompt_len=5) == 2
    assert prefix.common_prefix(ids[:2], mask[:2], prompt_len=5) == 2  # "5 6 7" is the whole shortest prompt
    assert prefix.common_prefix(ids[1:], mask[1:], prompt_len=5) == 2
    assert prefix.common_prefix(ids[:1], mask[:1], prompt_len=5) == 0  # one row: nothing to share
    other = ids.clone()
    other[1, 0] = 4  # row 1 starts with another token
    assert prefix.common_prefix(other, mask, prompt_len=5) == 0


@pytest.mark.parametrize(
    "other_rank, passes",
    [
        ((0, 0, 0), lambda n, prompt, rows: [(6, rows)]),  # another rank's prompts share nothing: the plain forward
        ((0, 2, 0), lambda n, prompt, rows: [(1, 2), (6, rows - 2)]),  # no repeats there, but 2 first tokens in common
        ((1, 0, 3), lambda n, prompt, rows: [(1, 3), (3, prompt - 3), (6, 3)]),  # repeats there too, a 3-token beginning
        ((1, 0, 99), lambda n, prompt, rows: [(1, n), (3, prompt - n), (6, 3)]),  # as this rank's own
    ],
    ids=["nothing", "a_beginning", "repeats_shorter", "repeats_longer"],
)
def test_sharded_ranks_agree_on_the_passes_and_each_gives_the_plain_logits(monkeypatch, other_rank, passes):
    """Under FSDP2 every forward gathers weights by collectives, so every rank must run the same passes
    whatever its prompts (a rank running a prefix pass that another skips waits forever: the two-process
    FSDP2 runs hung on that). With this rank's rows repeating 3 prompts that share a system prompt, and
    another rank's (distinct prompts, common beginning, distinct prompts' beginning) as given, the ranks
    take the distinct prompts only where both have repeats and the shorter beginnings; the trunk's first
    layer sees those passes, and the logits are the plain forward's."""
    module = make_module()
    ids, mask, response_len = group_batch(module, system=SYSTEM)
    ids, mask = prefix.trim_left_padding(ids, mask)
    n = len(module.tokenizer(SYSTEM, add_special_tokens=False)["input_ids"])
    monkeypatch.setattr(type(module.networks), "sharded", property(lambda self: True))
    calls = []

    def reduce(t, op="sum"):  # the max over this rank and the other of what each sends: the negated counts
        calls.append(op)
        return torch.maximum(t, -torch.tensor(other_rank, dtype=t.dtype))

    monkeypatch.setattr(module.networks, "reduce", reduce)
    seen = []
    hook = module.policy.model.layers[0].register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape[:2])))
    try:
        with torch.no_grad():
            sharded = module.networks.response_logits(module.policy, ids, mask, response_len)
            sharded_seen = seen[:]
            module.networks.shared_prompts = False
            plain = module.networks.response_logits(module.policy, ids, mask, response_len)
    finally:
        hook.remove()
    assert calls == ["max"]
    assert sharded_seen == passes(n, ids.shape[1] - response_len, ids.shape[1]) and seen[len(sharded_seen) :] == [(6, ids.shape[1])]
    torch.testing.assert_close(sharded, plain, rtol=0, atol=2e-5)


@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("critic", [None, "shared", "separate"])
def test_a_common_prefix_forward_gives_the_plain_forwards_logits_values_and_gradients(lora_rank, critic):
    """Distinct prompts that start alike (a system prompt) run those tokens once: the same logits, values
    and gradients of policy and critic as a plain forward, to fp32 rounding; the trunk's first layer sees
    the shared tokens once, then every row's rest."""
    groups = {"advantage_estimator": "rloo", "num_generations": 2} if critic is None else {}  # what the rows are does not matter here
    module = make_module(lora=dict(rank=lora_rank), optim=dict(critic_lr=None), critic=critic, **groups)
    if critic is not None:  # a zero value head (its initialisation) would pass no gradient to a trunk
        torch.nn.init.normal_(module.critic.head.weight, generator=torch.Generator().manual_seed(1))
    prompts = [SYSTEM + p for p in PROMPTS]
    enc = module.sampler.encode(prompts)
    response = torch.randint(5, 60, (3, 4), generator=torch.Generator().manual_seed(3))
    ids, mask = torch.cat([enc["input_ids"], response], 1), torch.cat([enc["attention_mask"], torch.ones_like(response)], 1)
    mask[-1, -1] = 0  # a response that ended early
    n = prefix.common_prefix(ids, mask, enc["input_ids"].shape[1])
    assert n == len(module.tokenizer(SYSTEM, add_special_tokens=False)["input_ids"]) > 10
    weights = torch.randn(3, 4, len(module.tokenizer), generator=torch.Generator().manual_seed(0))
    models = [m for m in (module.policy, module.critic) if m is not None]

    def outputs(shared: bool):
        module.networks.shared_prompts = shared
        for model in models:
            model.zero_grad(set_to_none=True)
        seen = []
        layer = next(m for m in module.policy.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)).layers[0]
        hook = layer.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape[:2])))
        try:
            logits, values = module.networks.policy_outputs(ids, mask, 4)
        finally:
            hook.remove()
        loss = (weights[..., : logits.shape[-1]] * logits).sum() + (0 if values is None else (values * torch.arange(4.0)).sum())
        loss.backward()
        grads = {n: p.grad.clone() for model in models for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), None if values is None else values.detach(), grads, seen

    shared_logits, shared_values, shared_grads, shared_seen = outputs(True)
    plain_logits, plain_values, plain_grads, plain_seen = outputs(False)
    assert shared_seen == [(1, n), (3, ids.shape[1] - n)] and plain_seen == [(3, ids.shape[1])]
    torch.testing.assert_close(shared_logits, plain_logits, rtol=0, atol=2e-5)
    if critic is not None:
        assert plain_values.abs().max() > 1e-3
        torch.testing.assert_close(shared_values, plain_values, rtol=0, atol=2e-5)
    assert shared_grads.keys() == plain_grads.keys() and len(plain_grads) > 0
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=2e-5, msg=name)


def test_grpo_trains_the_same_with_and_without_shared_prompts(tmp_path):
    """Two GRPO iterations (4 responses per prompt, k3 in the loss): the first iteration's rollout statistics
    (its reference forward, at the same weights) agree to 1e-5; its update's (means over the minibatches,
    all but the first after an AdamW step) and the second iteration's to 0.2% (AdamW moves a weight whose
    gradient is next to 0 by about the lr either way, so the rounding of such a gradient moves weights by up
    to 0.004 here: the weights themselves are not compared)."""

    def run(shared: bool):
        module = make_module(
            advantage_estimator="grpo",
            sampling=dict(num_generations=4),
            kl=dict(placement="loss"),
            optim=dict(critic_lr=None),
            runtime=dict(shared_prompts=shared),
            kl_estimator="k3",
        )
        return fit(module, tmp_path, iterations=2, batch_size=2)[1].rows

    (shared_first, shared_second), (plain_first, plain_second) = run(True), run(False)
    for key in ("objective/kl", "objective/reward", "policy/loss", "policy/kl_loss", "policy/approxkl"):
        before_any_step = key.startswith("objective/")
        assert shared_first[key] == pytest.approx(plain_first[key], rel=0 if before_any_step else 2e-3, abs=1e-5), key
        assert shared_second[key] == pytest.approx(plain_second[key], rel=2e-3, abs=1e-6), key
    assert plain_second["objective/kl"] > 0.1  # the second iteration's policy has moved from the reference


@pytest.mark.parametrize("system", ["", "You are a kind assistant. "])
def test_generate_on_shared_prompt_caches_samples_what_it_samples_without_them(system):
    """The hf engine prefills each distinct prompt once (prefix.prompt_cache; their common beginning once) and
    generate runs only the last prompt token per row: the same responses from the same seed, the same logits
    to fp32 rounding."""
    module = make_module(
        advantage_estimator="rloo", sampling=dict(num_generations=3, max_new_tokens=8), optim=dict(critic_lr=None), critic=None
    )
    enc = module.sampler.encode([system + PROMPTS[i] for i in (0, 0, 0, 1, 1, 1)])

    def sample(shared: bool):
        module.networks.shared_prompts = shared
        return module.rollout_engine.sample(module.sampler, enc, seed=5)

    shared, plain = sample(True), sample(False)
    assert torch.equal(shared.sequences, plain.sequences)
    assert shared.logits.shape == plain.logits.shape == (6, 8, shared.logits.shape[-1])
    torch.testing.assert_close(shared.logits, plain.logits, rtol=0, atol=2e-5)
    assert len(set(map(tuple, plain.sequences[:3, enc["input_ids"].shape[1] :].tolist()))) > 1  # the rows drew their own responses
    cache = prefix.prompt_cache(module.policy, enc["input_ids"], enc["attention_mask"])
    assert next(iter(cache.values())).get_seq_length() == enc["input_ids"].shape[1] - 1
    assert cache["attention_mask"].sum(-1).tolist() == enc["attention_mask"].sum(-1).tolist()  # every real token, once
    if not system:  # two prompts, one row each, nothing in common
        assert prefix.prompt_cache(module.policy, enc["input_ids"][2:4], enc["attention_mask"][2:4]) == {}


def test_generate_on_a_common_prefix_cache_samples_what_it_samples_without_it():
    """Distinct prompts that start alike: the hf engine prefills their common beginning once, then every row's
    prompt after it but the last token, with the attention mask that lines the cache up with the prompt's
    columns: the same responses from the same seed, the same logits and hidden states to fp32 rounding."""
    module = make_module(critic="shared", sampling=dict(max_new_tokens=8))
    enc = module.sampler.encode([SYSTEM + p for p in PROMPTS])

    def sample(shared: bool):
        module.networks.shared_prompts = shared
        return module.rollout_engine.sample(module.sampler, enc, seed=5)

    shared, plain = sample(True), sample(False)
    assert torch.equal(shared.sequences, plain.sequences)
    torch.testing.assert_close(shared.logits, plain.logits, rtol=0, atol=2e-5)
    torch.testing.assert_close(shared.hidden, plain.hidden, rtol=0, atol=2e-5)
    n = prefix.common_prefix(enc["input_ids"], enc["attention_mask"], enc["input_ids"].shape[1])
    cache = prefix.prompt_cache(module.policy, enc["input_ids"], enc["attention_mask"])
    assert n > 10 and cache["attention_mask"].shape == enc["attention_mask"].shape
    assert cache["attention_mask"].sum(-1).tolist() == enc["attention_mask"].sum(-1).tolist()  # every real token, once
    assert next(v for k, v in cache.items() if k != "attention_mask").get_seq_length() == enc["input_ids"].shape[1] - 1


def test_classify_shared_prefixes_scores_whole_rows_when_a_group_shares_nothing(tiny_classifier):
    """None (the caller scores whole rows) when a group's rows differ at their first token or a row's rest is
    padding only; otherwise the logits of the rows scored whole."""
    _, model, tokenizer = tiny_classifier
    pad = tokenizer.pad_token_id
    rows = [[5, 6, 7], [5, 6, 9, 10], [8, 6], [8, 6, 4]]
    with torch.no_grad():
        shared = prefix.classify_shared_prefixes(model, rows, ["a", "a", "b", "b"], pad)
        whole = torch.cat([model(input_ids=torch.tensor([row])).logits for row in rows])
        torch.testing.assert_close(shared, whole, rtol=1e-4, atol=1e-5)
        assert prefix.classify_shared_prefixes(model, [[5, 6], [7, 6]], ["a", "a"], pad) is None
        assert prefix.classify_shared_prefixes(model, [[5, 6, pad], [5, 6, 7]], ["a", "a"], pad) is None


@pytest.mark.parametrize("rows_of, passes", [((0, 1, 0, 2, 1, 0), "prompts, responses"), ((0, 1, 2), "whole rows")])
def test_sharded_forwards_with_autograd_run_no_beginning_pass(monkeypatch, rows_of, passes):
    """Under FSDP2 a pass over the prompts' common beginning reaches the loss only through the keys and values
    it caches, so FSDP2's backward would not gather its blocks' weights again: with autograd on, the sharded
    module runs the distinct prompts whole (or every row whole), and the gradients are the plain forward's."""
    module = make_module()
    ids, mask, response_len = group_batch(module, rows_of=rows_of, system=SYSTEM)
    ids, mask = prefix.trim_left_padding(ids, mask)
    monkeypatch.setattr(type(module.networks), "sharded", property(lambda self: True))
    monkeypatch.setattr(module.networks, "reduce", lambda t, op="sum": t)  # one rank
    seen, grads = [], []
    hook = module.policy.model.layers[0].register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape[:2])))
    try:
        for shared in (True, False):
            module.networks.shared_prompts = shared
            module.policy.zero_grad(set_to_none=True)
            module.networks.response_logits(module.policy, ids, mask, response_len).sum().backward()
            grads.append({n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None})
    finally:
        hook.remove()
    prompt_len, rows = ids.shape[1] - response_len, len(rows_of)
    expected = [(3, prompt_len), (rows, response_len - 1)] if passes == "prompts, responses" else [(rows, ids.shape[1])]
    assert seen == [*expected, (rows, ids.shape[1])]
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-4, atol=2e-5, msg=name)
