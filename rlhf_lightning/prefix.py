"""One forward pass over each distinct prompt of a batch, shared by every response sampled from it.

With several responses per prompt (``num_generations``: GRPO, RLOO, ...) a forward over the
prompt + response rows runs each prompt's tokens once per response. Here the distinct prompts go
through the model once, their keys and values are kept (the model's own KV cache) and indexed out
to their rows, and each row's response then runs on top of its prompt's: the logits of a plain
forward to rounding, and the same gradients (autograd carries each response's back through the
shared keys and values into the one prompt pass, where they add up). What it saves is the prompt
tokens' work on every response but one per prompt, in every reference forward and every update's
forward and backward (docs/performance.md has the prompts' share on a SmolLM2 workload).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import Tensor, nn


def trim_left_padding(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The rows without their leading columns that are padding in every row. Prompts are
    left-padded to the longest of the whole batch, so a minibatch of shorter ones carries columns
    that change no output (attention masks them out, positions count real tokens) but cost a
    forward's and a backward's work; the response positions, counted from the end, stay put."""
    first = int(attention_mask.any(0).int().argmax())  # 0 when the first column holds a real token
    return input_ids[:, first:], attention_mask[:, first:]


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, as ``generate`` does for left-padded prompts."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def distinct_prompts(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Optional[tuple[Tensor, Tensor]]:
    """``(first, inverse)``: the first row of each distinct prompt (its ids and mask over the first
    ``prompt_len`` columns) and, for every row, the index of its prompt in ``first``; None when no two
    rows share a prompt (nothing to save)."""
    prompts = input_ids[:, :prompt_len].masked_fill(attention_mask[:, :prompt_len] == 0, -1)
    unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    if len(unique) == len(prompts):
        return None
    rows = torch.arange(len(prompts), device=input_ids.device)
    first = torch.full((len(unique),), len(prompts), device=input_ids.device).scatter_reduce(0, inverse, rows, "amin")
    return first, inverse


def shared_prompt_logits(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    first: Tensor,
    inverse: Tensor,
    hidden: Optional[list] = None,
    beginning: Optional[int] = None,
) -> Tensor:
    """The logits predicting each of the last ``response_len`` tokens of every row, (batch, response_len,
    vocab), from one pass over the prompts ``first`` (:func:`distinct_prompts`) and one over the responses
    on their keys and values. ``hidden``: :func:`rlhf_lightning.models.float32_head`'s list of the output
    layer's inputs, left holding those positions' hidden states (batch, response_len, hidden).
    ``beginning``: how many first tokens of the prompts run once (:func:`_prompts_once`); None counts all
    they share (:func:`prompts_beginning`), and any smaller count holds too."""
    prompt_len = input_ids.shape[1] - response_len
    prompt_ids, prompt_mask = trim_left_padding(input_ids[first, :prompt_len], attention_mask[first, :prompt_len])
    heads = len(hidden) if hidden is not None else 0
    out, name, prompt_mask = _prompts_once(model, prompt_ids, prompt_mask, inverse, n=beginning)
    if hidden is not None:  # the output layer's input of the prompts' last position only, not of a common beginning's pass
        hidden[heads:] = hidden[-1:]
    logits = [out.logits[inverse]]  # the prompt's last position predicts the first response token
    if response_len > 1:
        cache = getattr(out, name)
        cache.shared_prompts = True  # marked for whoever counts passes (tools/benchmarks/bench/measure.py): the rest of this one
        mask = torch.cat([prompt_mask[inverse], attention_mask[:, prompt_len:-1]], dim=1)
        positions = position_ids(attention_mask)[:, prompt_len:-1]  # counted over the whole row's real tokens
        out = model(input_ids=input_ids[:, prompt_len:-1], attention_mask=mask, position_ids=positions, use_cache=True, **{name: cache})
        logits.append(out.logits)
    if hidden is not None:  # the output layer's inputs: the prompts' last position, then the responses'
        hidden[:] = [torch.cat([hidden[0][inverse], *hidden[1:]], dim=1)]
    return torch.cat(logits, dim=1)


def prompts_beginning(input_ids: Tensor, attention_mask: Tensor, response_len: int, first: Tensor) -> int:
    """How many first tokens the distinct prompts ``first`` share as :func:`shared_prompt_logits` runs them."""
    prompt_len = input_ids.shape[1] - response_len
    ids, mask = trim_left_padding(input_ids[first, :prompt_len], attention_mask[first, :prompt_len])
    return common_prefix(ids, mask, ids.shape[1])


def common_prefix(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> int:
    """How many first real tokens every row's prompt starts with (after its left padding: a chat
    template's system prompt and turn header), short of each prompt's last token, whose position
    predicts the first response token; 0 when the rows differ from their first token or are one."""
    lengths = attention_mask[:, :prompt_len].sum(-1)
    shortest = int(lengths.min()) - 1
    if len(input_ids) < 2 or shortest < 1:
        return 0
    starts = prompt_len - lengths  # the prompts' real tokens end where the responses begin
    tokens = input_ids.gather(1, starts[:, None] + torch.arange(shortest, device=input_ids.device))
    return int((tokens == tokens[:1]).all(0).int().cumprod(0).sum())


def on_common_prefix(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, n: int, causal_lm: bool = True, **kwargs: Any) -> Any:
    """``model``'s output over the columns after the first ``n`` of rows whose real tokens all start with
    the same ``n`` (:func:`common_prefix`), from one pass over those ``n`` tokens (one row's; their keys
    and values indexed out to every row, so gradients add up there) and one over the rest of every row on
    them: the outputs of a plain forward over those columns, to rounding. Each row's prefix lies within the
    first ``n`` columns or their left padding (the longest row starts at column 0), so the rest is the
    columns from ``n`` on, masked where a shorter row's prefix sits. ``causal_lm``: ``model`` has an output
    layer (the first pass computes one position's logits); ``kwargs`` go to the second pass."""
    start = int(attention_mask[0].int().argmax())
    ones = torch.ones(1, n, dtype=attention_mask.dtype, device=attention_mask.device)
    out, name, _ = _prompts_once(model, input_ids[:1, start : start + n], ones, torch.zeros_like(input_ids[:, 0]), causal_lm)
    cache = getattr(out, name)
    cache.shared_prompts = True  # the rest of this pass, for whoever counts passes (tools/benchmarks/bench/measure.py)
    mask, positions = _after_prefix_mask(attention_mask, n), position_ids(attention_mask)[:, n:]
    return model(input_ids=input_ids[:, n:], attention_mask=mask, position_ids=positions, **{name: cache}, **kwargs)


def _after_prefix_mask(attention_mask: Tensor, n: int) -> Tensor:
    """The attention mask over a KV cache that holds the ``n`` shared first tokens once, then every row's
    columns after the first ``n`` (:func:`on_common_prefix`), a shorter row's own copy of them masked."""
    rest = attention_mask * (position_ids(attention_mask) >= n)
    return torch.cat([torch.ones_like(attention_mask[:, :n]), rest[:, n:]], dim=1)


def prompt_cache(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> dict:
    """``generate``'s keyword arguments for a KV cache of every row's prompt but its last token (``generate``
    then runs only the last prompt token, for every row, and samples as it would have): from one pass over
    each distinct prompt (:func:`_prompts_once`, their common beginning once), every row its own prompt
    where none repeats, with the attention mask that lines that cache up with the columns of
    ``input_ids``; {} when rows share neither prompts nor a beginning."""
    if input_ids.shape[1] < 2:
        return {}
    shared = distinct_prompts(input_ids, attention_mask, input_ids.shape[1])
    if shared is None and not common_prefix(input_ids[:, :-1], attention_mask[:, :-1], input_ids.shape[1] - 1):
        return {}
    rows = torch.arange(len(input_ids), device=input_ids.device)
    first, inverse = (rows, rows) if shared is None else shared  # every row its own prompt: their common beginning once
    out, name, mask = _prompts_once(model, input_ids[first, :-1], attention_mask[first, :-1], inverse)
    return {name: getattr(out, name), "attention_mask": torch.cat([mask[inverse], attention_mask[:, -1:]], dim=1)}


def classify_shared_prefixes(model: nn.Module, rows: list[list[int]], groups: list[int], pad_id: int) -> Optional[Tensor]:
    """A causal sequence classifier's logits (rows, labels) on token ``rows``, each group of rows (``groups``:
    the group of every row, e.g. its prompt) running the tokens all its rows start with once: the distinct
    prefixes in one pass, their KV cache indexed out to the rows, then each row's remaining tokens (at least
    one) on it; the classifier pools at the last token that is not ``pad_id``, as on the whole row. None (score
    whole rows) when a group's rows share no first token, or some row's remaining tokens are all ``pad_id``
    (its pooled token would lie in the prefix)."""
    keys = sorted(set(groups))
    group_of = [keys.index(g) for g in groups]  # each row's group, as an index into keys
    firsts = [rows[groups.index(key)] for key in keys]
    prefix_len = [len(first) - 1 for first in firsts]  # every row keeps at least its last token
    for row, g in zip(rows, group_of, strict=True):  # the longest prefix every row of the group shares
        shared = min(prefix_len[g], len(row) - 1)
        prefix_len[g] = next((i for i in range(shared) if row[i] != firsts[g][i]), shared)
    if min(prefix_len) < 1:  # a group's rows differ from their first token: nothing to share
        return None
    rests = [row[prefix_len[g] :] for row, g in zip(rows, group_of, strict=True)]
    if any(all(t == pad_id for t in rest) for rest in rests):
        return None
    prefixes = [first[:n] for first, n in zip(firsts, prefix_len, strict=True)]
    width = max(prefix_len)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prefixes])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes])
    device = next(model.parameters()).device
    ids, mask, inverse = ids.to(device), mask.to(device), torch.tensor(group_of, device=device)
    out, name, mask = _prompts_once(model, ids, mask, inverse, causal_lm=False)
    longest = max(len(rest) for rest in rests)
    rest_ids = torch.tensor([rest + [pad_id] * (longest - len(rest)) for rest in rests], device=device)
    rest_mask = torch.tensor([[1] * len(rest) + [0] * (longest - len(rest)) for rest in rests], device=device)
    positions = torch.tensor(prefix_len, device=device)[inverse, None] + torch.arange(longest, device=device)
    full_mask = torch.cat([mask[inverse], rest_mask], dim=1)
    cache = getattr(out, name)
    cache.shared_prompts = True  # the rest of this pass, for whoever counts passes (tools/benchmarks/bench/measure.py)
    return model(input_ids=rest_ids, attention_mask=full_mask, position_ids=positions, **{name: cache}).logits


def _prompts_once(
    model: nn.Module, ids: Tensor, mask: Tensor, inverse: Tensor, causal_lm: bool = True, n: Optional[int] = None
) -> tuple[Any, str, Tensor]:
    """One pass over the distinct prompts ``ids`` (a causal LM: the last position's logits only; else a
    sequence classifier), their first ``n`` tokens run once (:func:`on_common_prefix`: a chat template's
    system prompt; None: all they share), and the name of its KV cache in the output, the cache indexed out
    to every row (``inverse``; index_select: differentiable), with the attention mask (one row per prompt)
    that lines the cache up with the columns of ``ids``."""
    keep = {"logits_to_keep": 1} if causal_lm else {}
    n = common_prefix(ids, mask, ids.shape[1]) if n is None else n
    name = cache_argument(model)
    if n:
        out = on_common_prefix(model, ids, mask, n, causal_lm, use_cache=True, **keep)
        getattr(out, name).shared_prompts = False  # later passes on it (generate's steps) are passes of their own
        mask = _after_prefix_mask(mask, n)
    else:
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True, **keep)
    getattr(out, name).reorder_cache(inverse)
    return out, name, mask


def cache_argument(model: nn.Module) -> str:
    """The name of the KV cache in the model's forward and output: ``cache`` in recent transformers (5.24),
    ``past_key_values`` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel's own takes **kwargs
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
