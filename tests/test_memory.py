"""Memory per process is bounded by the settings (issue 65): how far the sampler runs ahead allocates nothing of
the size of ``model.off_policy.max_staleness``; a prompt file's long line is refused before any batch is padded to
it; the start-up estimate (rlhf_lightning/memory.py) by hand, and its refusal through the command."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from rlhf_lightning.async_rollout import needed_versions
from rlhf_lightning.checks import ConfigError
from rlhf_lightning.memory import GIB, ModelSize, Term, check, estimate, meta_model, model_size
from rlhf_lightning.module import PPORLHF

from helpers import CONFIGS, REPO, char_reward, cli, fit, make_module


def brute_needed(versions, iteration, k, first, handed):
    """The definition, batch by batch (O(k)): what ``AsyncRollouts.prune`` computed before issue 65."""
    pending = [j for j in range(iteration + 1, iteration + k + 1) if j not in handed]
    return {max(first, j - k) for j in pending} & set(versions)


def test_needed_versions_is_the_definition_without_walking_the_k_batches():
    for k, first, iteration in itertools.product(range(1, 5), range(3), range(7)):
        if iteration < first:
            continue
        versions = set(range(first, iteration + 1))
        for handed in ({}, {iteration + 1: 0}, {iteration + 1: 0, iteration + 2: 0}, {iteration + 2: 0}):
            assert needed_versions(versions, iteration, k, first, handed) == brute_needed(versions, iteration, k, first, handed), (
                k,
                first,
                iteration,
                handed,
            )
    # k = 10**12 at iteration 5: batch v + k may still come for every version (a longer run resumed from this one)
    assert needed_versions(range(6), 5, 10**12, 0, {}) == set(range(6))


def test_a_staleness_beyond_the_run_keeps_a_version_per_iteration_and_trains_what_k_equal_to_the_run_trains(tmp_path):
    """k = 10**12 over 2 epochs of 2 iterations (the list of k batches it once built filled the memory): the run ends
    holding its 4 published versions (min(k, iterations) + 1 at most: what a longer run resumed from it would
    sample from) and trains the weights of k = 4, the run's length (every batch from the starting weights)."""
    weights = {}
    for k in (10**12, 4):
        module = make_module(sampling=dict(old_logprobs="forward", max_new_tokens=12), ppo=dict(epochs=1), off_policy=dict(max_staleness=k))
        fit(module, tmp_path / str(k), iterations=2, batch_size=4, max_epochs=2)
        assert set(module.async_rollouts.versions) == {0, 1, 2, 3}
        weights[k] = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    assert all(torch.equal(weights[10**12][name], weights[4][name]) for name in weights[4])


def test_a_prompt_files_long_line_is_refused_by_the_command_naming_its_line_without_padding_the_file_to_it(tmp_path):
    """2,000 prompts and one line of 120,000 characters (as many tokens for the tiny model's character tokenizer):
    the check once padded every prompt to it (2,001 x 120,000 ids and mask, 3.8 GB) before refusing it; now it counts
    tokens per prompt and names the file, the line and model.prompts.max_length, at the memory of any start."""
    lines = [f"a short prompt number {i}" for i in range(2000)]
    lines[1499] = "x" * 120_000
    (tmp_path / "big.txt").write_text("\n".join(lines) + "\n")
    time = shutil.which("time", path="/usr/bin")
    command = ("fit", "--config", str(CONFIGS / "tiny.yaml"), "--data.train_path", "big.txt")
    result = cli(tmp_path, *command) if time is None else timed_cli(tmp_path, time, *command)
    assert result.returncode == 2, result.stderr[-2000:]
    assert re.search(
        r"error: data.train_path: prompt 1499 \('x+'\.\.\., prompt file 'big.txt', line 1500\) is 120000 tokens, longer than "
        r"model.prompts.max_length=256 \(1 such distinct prompts\)",
        result.stderr,
    ), result.stderr[-2000:]
    if time is not None:
        peak_kib = int(re.search(r"maxrss_kib=(\d+)", result.stderr).group(1))
        assert peak_kib < 1_500_000  # about 500 MB measured (2026-12-07); the padded batch alone was 3.8 GB


def timed_cli(cwd, time: str, *args: str) -> subprocess.CompletedProcess:
    """``rlhf-lightning <args>`` in ``cwd`` under ``/usr/bin/time``, its peak RSS as ``maxrss_kib=N`` in stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    command = [time, "-f", "maxrss_kib=%M", sys.executable, "-m", "rlhf_lightning.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_the_tiny_models_size_by_hand():
    """The tiny Llama (hidden 64, MLP 128, 2 layers, 4 heads of 16, untied head) over the character tokenizer's 78
    tokens: embedding 78 x 64 = 4,992; a layer: q, k, v, o 4 x 64 x 64 = 16,384, gate, up, down 3 x 64 x 128 = 24,576,
    two norms 128: 41,088, x 2 = 82,176; the final norm 64; the head 4,992: 92,224, of which the trunk (all but the
    head) 87,232. A rank-4 adapter on every linear layer but the head: r (in + out) = 4 x 128 = 512 on each of q, k, v,
    o, 4 x 192 = 768 on each of gate, up, down: 4,352 a layer, 8,704 in all."""
    size = model_size(meta_model("tiny", 78), lora_rank=4)
    assert size == ModelSize(params=92_224, adapter=8_704, trunk=87_232, vocab=78, hidden=64, intermediate=128, layers=2, kv_width=64)
    assert model_size(meta_model("tiny", 78), lora_rank=4, target_modules=["q_proj"]).adapter == 2 * 512


TINY = ModelSize(params=92_224, adapter=8_704, trunk=87_232, vocab=78, hidden=64, intermediate=128, layers=2, kv_width=64)


def test_the_estimate_by_hand():
    """16 rows of 10 prompt + 24 new tokens, micro-batches of 8, float32 (4 bytes):

    full fine-tuning, a separate critic (trunk + head: 87,232 + 65 = 87,297):
      weights       policy 92,224 + its frozen copy 92,224 + critic 87,297 = 271,745 values        1,086,980 bytes
      optimizer     3 x (92,224 + 87,297) = 538,563 values (gradients, AdamW's two moments)      2,154,252
      update        activations 2 layers x 8 x 34 tokens x (8 x 64 + 4 x 128 = 1,024) x 4       2,228,224
                    + logits 3 x 8 x 25 x 78 x 4                                                  187,200
    LoRA rank 4, a shared critic (head 65), an estimator that needs logits, max_staleness 2 over 2 epochs of 20:
      weights       policy 92,224 + adapter 8,704 = 100,928 values                                  403,712
      optimizer     3 x (8,704 + 65) x 4                                                            105,228
      logits kept   pi_old's and pi_ref's, 2 x 16 x 24 x 78 x 4                                     239,616
      ahead         its copy (92,224 + 8,704) x 4 = 403,712, min(2 + 1, 40) = 3 versions of the
                    adapter 3 x 8,704 x 4 = 104,448, min(2, 20 - 1) = 2 batches of engine and
                    reference logits 2 x 2 x 16 x 24 x 78 x 4 = 479,232                             987,392"""
    shape = dict(rows=16, prompt_tokens=10, new_tokens=24, micro_rows=8)
    full = {t.name: t.bytes for t in estimate(TINY, **shape, lora=False, critic="separate")}
    assert full["weights"] == 1_086_980
    assert full["gradients and AdamW's moments"] == 2_154_252
    assert full["logits kept for the KL"] == 0
    assert full["one micro-batch's activations and logits"] == 2_228_224 + 187_200
    lora = estimate(
        TINY, **shape, lora=True, critic="shared", needs_logits=True, staleness=2, iterations=40, batches_per_epoch=20, process=10**8
    )
    by_name = {t.name: t.bytes for t in lora}
    assert by_name["weights"] == 403_712
    assert by_name["gradients and AdamW's moments"] == 105_228
    assert by_name["logits kept for the KL"] == 239_616
    assert by_name["the sampler running ahead (3 versions, 2 drawn ahead)"] == 987_392
    assert by_name["the process so far (torch, the tokenizer, the prompts)"] == 10**8
    # a huge staleness counts what can exist: a version per iteration of the run, the epoch's batches less one ahead
    huge = {
        t.name: t.bytes for t in estimate(TINY, **shape, lora=True, critic="shared", staleness=10**12, iterations=40, batches_per_epoch=20)
    }
    assert huge["the sampler running ahead (40 versions, 19 drawn ahead)"] == 403_712 + 40 * 8_704 * 4 + 19 * 16 * 24 * 78 * 4


def test_past_the_available_memory_the_check_names_the_largest_terms_and_their_settings():
    terms = [Term("weights", 3 * GIB, "set model.lora.rank"), Term("logits", 9 * GIB, "lower data.batch_size"), Term("x", 1, "y")]
    assert check(terms, 16 * GIB, "available").startswith(
        "memory: about 12.00 GiB per process at its peak (weights 3.00, logits 9.00, x 0.00)"
    )
    with pytest.raises(ConfigError) as err:
        check(terms, 8 * GIB, "available (MemAvailable)")
    assert str(err.value).startswith(
        "memory: this run needs about 12.0 GiB per process, more than the 8.0 GiB available (MemAvailable). The largest terms: "
        "logits 9.00 GiB (lower data.batch_size); weights 3.00 GiB (set model.lora.rank)."
    )
    assert "RLHF_LIGHTNING_MEMORY_CHECK=warn" in check(terms, 8 * GIB, "available", mode="warn")


def test_a_run_that_cannot_fit_is_refused_by_the_command_before_any_model_loads(tmp_path, monkeypatch):
    """100,000 responses per prompt (1.6 million rows an iteration): the command exits with status 2 and one line
    naming the settings that lower the largest terms; in-process, no model has loaded when it is raised; the
    environment variable that lets it run anyway is checked, naming its choices."""
    result = cli(tmp_path, "fit", "--config", str(CONFIGS / "tiny.yaml"), "--model.sampling.num_generations=100000")
    assert result.returncode == 2, result.stderr[-2000:]
    error = next(line for line in result.stderr.splitlines() if line.startswith("error: "))
    assert re.match(r"error: memory: this run needs about [\d.]+ GiB per process, more than the [\d.]+ GiB available", error), error
    assert "one micro-batch's activations and logits" in error and "model.sampling.num_generations" in error
    assert "raise model.ppo.num_minibatches or model.ppo.gradient_accumulation_steps" in error

    def no_models(self, empty=False):
        raise AssertionError("a model loaded before the memory check")

    monkeypatch.setattr(PPORLHF, "load_policy", no_models)
    module = PPORLHF(policy="tiny", reward_model=char_reward(), sampling=dict(num_generations=100_000, max_new_tokens=24))
    with pytest.raises(ConfigError, match=r"^memory: this run needs about"):
        fit(module, tmp_path, iterations=1, batch_size=16)
    monkeypatch.setenv("RLHF_LIGHTNING_MEMORY_CHECK", "maybe")
    with pytest.raises(ConfigError, match=r"^RLHF_LIGHTNING_MEMORY_CHECK must be one of error, warn, off, got 'maybe'"):
        fit(PPORLHF(policy="tiny", reward_model=char_reward()), tmp_path, iterations=1, batch_size=16)
