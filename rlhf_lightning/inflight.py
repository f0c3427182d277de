"""In-flight weight updates (``model.off_policy.inflight_every`` N > 0, ``max_staleness`` k >= 2; docs/async.md): the
asynchronous sampler moves the responses it is drawing to newer weights between tokens, at points the run declares.

The schedule is a function of the iteration and the position alone, never of timing: token t of the batch of
iteration i is drawn from version

    v_i(t) = min(newest_i, v0_i + floor(t / N)),   v0_i = max(first, i - k),   newest_i = max(v0_i, i - 1)

(``first``: the oldest version there is, 0 unless a run resumed without its batches in flight), so a run whose
sampler is a thread trains the very weights of one whose sampler is the trainer's own thread. Version i - 1 is the
newest a batch may take without a wait that never ends: the trainer publishes version j at the start of iteration j
and then waits for batch j; batch i waits at most for version i - 1, published before the trainer waits for batch
i - 1, which the sampler (one thread, the batches in order of their iterations) drew before batch i, needing only
versions up to i - 2. Nothing waits for itself.

At a switch the responses continue from their prefix with the next version's weights by a fresh forward over the
prompt and the whole prefix (the engine called again on them; no KV cache carried across versions), so token t's
behaviour log-prob is exactly that version's, log mu_{v(t)}(y_t | x, y_<t), and the response's behaviour probability
is mu(y | x) = prod_t mu_{v(t)}(y_t | x, y_<t): ``Trajectory.sampler_logprobs`` holds it per token, and the
``sequence`` correction pi_prox(y | x) / mu(y | x) divides by that product (``sampling.correction_weights``). A KV cache
carried over (PipelineRL's) would draw the new tokens from the new weights' queries on the old weights' keys and
values: a distribution that is no version's, which the trainer cannot recompute.

Each segment is one ``RolloutEngine.checked_sample`` call on a view of the sampler whose ``sampling`` says the
segment's ``max_new_tokens`` (and what is left of ``min_new_tokens``), with its own seed: the iteration's seed for the
first segment (so a schedule without a switch draws today's responses), ``seed + s * SEGMENT_SEED`` for segment s."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from rlhf_lightning.interfaces import Samples
from rlhf_lightning.sampler import Drawn, Sampler

SEGMENT_SEED = 15485863  # a prime: segment s of a batch draws with the batch's seed + s * SEGMENT_SEED


def token_versions(iteration: int, max_staleness: int, every: int, length: int, first_version: int = 0) -> list[int]:
    """The version each of the ``length`` response positions of iteration ``iteration``'s batch is drawn from (module
    docstring): min(max(v0, i - 1), v0 + t // every), v0 = max(first_version, i - max_staleness); ``every`` 0: v0 alone."""
    v0 = max(first_version, iteration - max_staleness)
    if not every:
        return [v0] * length
    newest = max(v0, iteration - 1)
    return [min(newest, v0 + t // every) for t in range(length)]


class InflightDraw:
    """One batch drawn segment by segment along :func:`token_versions`: each run of positions that one version draws is
    one engine call on that version's weights (``view_of(version)``, which waits for the version to be published),
    continuing every unfinished response from its prefix; a response that ended (EOS) is drawn on no more, pad after it.

    ``every``: ``model.off_policy.inflight_every``; ``max_staleness``: k."""

    def __init__(self, every: int, max_staleness: int) -> None:
        self.every, self.k = every, max_staleness

    def versions(self, iteration: int, length: int, first_version: int) -> list[int]:
        return token_versions(iteration, self.k, self.every, length, first_version)

    def newest(self, iteration: int, length: int, first_version: int) -> int:
        """The newest version the batch of ``iteration`` may need: it can be drawn whole once that one is published."""
        return self.versions(iteration, length, first_version)[-1]

    def draw(
        self, view_of: Callable[[int], Sampler], prompts: list[str], enc: dict[str, Tensor], iteration: int, first_version: int
    ) -> Drawn:
        view = view_of(max(first_version, iteration - self.k))
        full, tokenizer = view.sampling, view.tokenizer
        eos, pad, seed = tokenizer.eos_token_id, tokenizer.pad_token_id, view.seed(iteration)
        schedule = self.versions(iteration, full.max_new_tokens, first_version)
        ids = enc["input_ids"]
        ended = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
        pieces: list[Samples] = []
        t, segment = 0, 0
        while t < len(schedule) and not ended.all():
            version = schedule[t]
            end = t + sum(1 for v in schedule[t:] if v == version)  # the versions never go back: one run
            if segment:
                view = view_of(version)
            view.sampling = dataclasses.replace(full, max_new_tokens=end - t, min_new_tokens=min(max(0, full.min_new_tokens - t), end - t))
            if view.engine.stale(view):
                view.engine.sync(view)
            # only the responses still going are drawn on: each prompt, then its prefix (no EOS in it yet, all attended)
            rows = (~ended).nonzero()[:, 0]
            attention = torch.cat([enc["attention_mask"][rows], enc["attention_mask"].new_ones(len(rows), t)], dim=1)
            samples = view.engine.checked_sample(view, {"input_ids": ids[rows], "attention_mask": attention}, seed + segment * SEGMENT_SEED)
            drawn = samples.sequences[:, ids.shape[1] :].to(ids.device)
            new = torch.full((len(ids), drawn.shape[1]), pad, dtype=ids.dtype, device=ids.device)  # an ended response: pad
            new[rows] = drawn
            pieces.append(Samples(new, *[_spread(getattr(samples, name), rows, len(ids)) for name in ("logits", "logprobs", "hidden")]))
            ids = torch.cat([ids, new], dim=1)
            ended = ended | (new == eos).any(-1)
            t, segment = t + new.shape[1], segment + 1
        samples = Samples(ids, *[_cat([getattr(p, name) for p in pieces]) for name in ("logits", "logprobs", "hidden")])
        versions = torch.tensor(schedule[:t], dtype=torch.long, device=ids.device).expand(len(ids), -1).clone()
        return Drawn(iteration, list(prompts), enc, samples, schedule[0], token_versions=versions)


def _spread(scores: Optional[Tensor], rows: Tensor, batch: int) -> Optional[Tensor]:
    """A segment's scores of the responses still going (``rows``) in the batch's rows, 0 for an ended one (masked)."""
    if scores is None:
        return None
    out = scores.new_zeros(batch, *scores.shape[1:])
    out[rows.to(scores.device)] = scores
    return out


def _cat(parts: list[Optional[Tensor]]) -> Optional[Tensor]:
    """The segments' scores along the response (dim 1), or None where the engine returned none."""
    return None if any(p is None for p in parts) else torch.cat(parts, dim=1)
