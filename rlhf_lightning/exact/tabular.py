"""Tabular autoregressive policies: one logit vector per prefix, every response enumerable.

A table over K tokens and responses of length L is a list of L tensors, ``table[t]`` of shape
(K ** t, K): the logits of pi(. | y_<t) for each of the K ** t prefixes of length t, in lexicographic
order (prefix (y_0, ..., y_{t-1}) is row sum_tau y_tau K ** (t - 1 - tau)). With the responses of
:func:`enumerate_responses` every expectation over y ~ pi is a finite sum, so the expected gradient
of any per-token loss can be computed exactly: sum_y sg(pi_old(y)) grad loss(y). This is the ground
truth for the sequence-level KL (ppo_math.kl_to_go_loss, tests/test_sequence_kl.py,
tools/studies/kl_estimator_report.py): no Lightning, no model.

Responses that end at EOS live in the same trees, over K + 1 symbols, the last one EOS: a response of
n < L content tokens then EOS is the path of those tokens, EOS and EOS again up to length L (EOS
absorbs: after it the only continuation is EOS, with probability 1); L content tokens without EOS is a
response cut at the length limit. A path with a content token after an EOS is no response
(:func:`valid_responses`): its log-probability is -inf, and every function here treats a state that
no response reaches as carrying no mass (its conditionals -inf, never NaN).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor


def enumerate_responses(num_tokens: int, length: int) -> Tensor:
    """Every response of ``length`` tokens over ``num_tokens`` content tokens, lexicographic:
    (num_tokens ** length, length) token indices."""
    return torch.tensor(list(itertools.product(range(num_tokens), repeat=length)), dtype=torch.long).view(-1, length)


def valid_responses(responses: Tensor, eos: int) -> Tensor:
    """Whether each path of the tree over K + 1 symbols (``eos`` the EOS index) is a response: no content
    token after an EOS. (N, L) -> (N,) bool."""
    after_eos = (responses == eos).long().cummax(-1).values.bool()
    return ~(after_eos & (responses != eos)).any(-1)


def response_lengths(responses: Tensor, eos: int) -> Tensor:
    """Tokens of each response up to and including its first EOS (``eos`` the EOS index), or all L
    for a response cut without one: what the response mask covers. (N, L) -> (N,) long."""
    is_eos = responses == eos
    return torch.where(is_eos.any(-1), is_eos.long().argmax(-1) + 1, torch.full_like(responses[:, 0], responses.shape[1]))


def log_normalise(log_joint: Tensor) -> Tensor:
    """log of ``log_joint``'s last dimension normalised (a conditional from joint masses): -inf, not
    NaN, where the whole row is -inf (a state no response reaches)."""
    norm = log_joint.logsumexp(-1, keepdim=True)
    return torch.where(norm > -math.inf, log_joint - norm, torch.full_like(log_joint, -math.inf))


def expected_log_ratio(logp: Tensor, logq: Tensor) -> Tensor:
    """sum over the last dimension of p (log p - log q), with 0 log 0 = 0 (also where q is 0 too)."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros((), dtype=p.dtype)).sum(-1)


def prefix_index(responses: Tensor, num_tokens: int) -> Tensor:
    """Row of the prefix y_<t in ``table[t]`` for every response and position: (N, L) -> (N, L)."""
    index = torch.zeros_like(responses)
    for t in range(1, responses.shape[1]):
        index[:, t] = index[:, t - 1] * num_tokens + responses[:, t - 1]
    return index


def random_table(num_tokens: int, length: int, scale: float, generator: torch.Generator, dtype=torch.float64) -> list[Tensor]:
    """Logits ``scale`` * N(0, 1) for every prefix: a random, prefix-dependent policy."""
    return [scale * torch.randn(num_tokens**t, num_tokens, generator=generator, dtype=dtype) for t in range(length)]


def order_dependent_tables(
    num_tokens: int, length: int, seed: int = 0, push: float = 4.0, old_move: float = 0.25
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """(pi_ref, pi_theta, pi_old) tables where the KL still to come depends on the token just chosen:
    pi_ref random (logits N(0, 1)); pi_theta = pi_ref + 0.1 N(0, 1) + ``push`` on token 0's logit at every
    state whose last token is 0 (after a 0 the continuation leaves pi_ref, elsewhere it stays close);
    pi_old = pi_theta + ``old_move`` N(0, 1): the sampler a few PPO epochs ago. pi_theta requires grad."""
    generator = torch.Generator().manual_seed(seed)
    ref = random_table(num_tokens, length, 1.0, generator)
    theta = [r + n for r, n in zip(ref, random_table(num_tokens, length, 0.1, generator), strict=True)]
    for t in range(1, length):
        theta[t][enumerate_responses(num_tokens, t)[:, -1] == 0, 0] += push
    old = [t + m for t, m in zip(theta, random_table(num_tokens, length, old_move, generator), strict=True)]
    return ref, [t.requires_grad_() for t in theta], old


def position_logits(table: Sequence[Tensor], responses: Tensor) -> Tensor:
    """The logits at every position of every response: (N, L, K)."""
    index = prefix_index(responses, table[0].shape[-1])
    return torch.stack([table[t][index[:, t]] for t in range(len(table))], dim=1)


def token_logprobs(table: Sequence[Tensor], responses: Tensor) -> Tensor:
    """log pi(y_t | y_<t) of every response and position: (N, L)."""
    logits = position_logits(table, responses).log_softmax(-1)
    return logits.gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """KL(pi || pi_ref) of the whole response, sum_y pi(y) (log pi(y) - log pi_ref(y)), from the per-token
    log-probs (N, L) of every response; differentiable in both."""
    seq, ref_seq = logprobs.sum(-1), ref_logprobs.sum(-1)
    return (seq.exp() * (seq - ref_seq)).sum()


def state_probabilities(table: Sequence[Tensor]) -> list[Tensor]:
    """d(s) = pi(y_<t) for every prefix of every length t < L: shapes (K ** t,), as ``table``."""
    num_tokens = table[0].shape[-1]
    probs = [torch.ones(1, dtype=table[0].dtype)]
    for t in range(1, len(table)):
        step = table[t - 1].detach().softmax(-1)  # (K ** (t-1), K)
        probs.append((probs[-1].unsqueeze(-1) * step).reshape(num_tokens**t))
    return probs


def expected_gradient(loss_fn, table: Sequence[Tensor], responses: Tensor, old_table: Optional[Sequence[Tensor]] = None) -> list[Tensor]:
    """sum_y sg(pi_old(y)) grad_table sum_t loss_t(y): the exact expectation of the gradient of a
    per-token loss over responses drawn from ``old_table`` (default: ``table`` itself, on-policy).
    ``loss_fn(logprobs, old_logprobs, logits)`` returns the (N, L) per-token loss; ``table``'s
    tensors must require grad."""
    old = table if old_table is None else old_table
    logits = position_logits(table, responses)
    logprobs = logits.log_softmax(-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    old_logprobs = token_logprobs([t.detach() for t in old], responses)
    weights = old_logprobs.sum(-1).exp()  # pi_old(y), no gradient
    loss = (weights.unsqueeze(-1) * loss_fn(logprobs, old_logprobs, logits)).sum()
    return list(torch.autograd.grad(loss, list(table)))


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.flatten() for t in tensors])


def cosine(a: Tensor, b: Tensor) -> float:
    return float(a @ b) / max(float(a.norm()) * float(b.norm()), 1e-300)


def sum_after(tree: Tensor, tokens: int, log: bool = False) -> Tensor:
    """A response tree (prompts, K, ..., K) summed (``log``: log-sum-exp) over every position after the first
    ``tokens``: (prompts, K, ..., K) with ``tokens`` token dimensions."""
    later = tuple(range(tokens + 1, tree.dim()))
    if not later:
        return tree
    return tree.logsumexp(later) if log else tree.sum(later)


def reward_to_go(probs: Tensor, rewards: Tensor, tokens: int) -> Tensor:
    """E[r | x, the first ``tokens`` tokens] under ``probs``, both response trees (prompts, K, ..., K)."""
    return sum_after(probs * rewards, tokens) / sum_after(probs, tokens).clamp(min=1e-300)


def conditional_tables(logprobs: Tensor, num_tokens: int) -> list[Tensor]:
    """log pi(a | x, y_<t) from log pi(y | x) over whole responses (prompts, K ** L), in the order of
    :func:`enumerate_responses`: L tables (prompts * K ** t, K), prompt-major (row p * K ** t + prefix)."""
    prompts, responses = logprobs.shape
    length = round(math.log(responses, num_tokens))
    tree = logprobs.view(prompts, *[num_tokens] * length)
    tables = []
    for t in range(length):
        joint = sum_after(tree, t + 1, log=True)  # log P(x, y_<=t)
        tables.append(log_normalise(joint).reshape(-1, num_tokens))
    return tables
