"""The GPU paths, as far as a CPU proves them (issue 33): one optimizer with parameter groups,
clipping after 16-mixed's unscaling with a real GradScaler, DeepSpeed's settings, bit-exact LoRA
merges on a bf16-true base, float32 log-probs and rewards outside autocast under bf16-mixed, the
rollout's memory, the RNG state of another GPU count, and the CPU-fallback warning. What only a
GPU shows: tools/gpu_check.py (docs/distributed.md)."""

from __future__ import annotations

import contextlib
import copy
import random
import threading
import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rlhf_lightning import checkpoints, gpu
from rlhf_lightning.args import RuntimeArgs, SamplingArgs
from rlhf_lightning.checks import ConfigError
from rlhf_lightning.models import float32_head, merged_adapter

from helpers import fit, make_module

PROMPTS = ["Write a short review of a train journey.", "Hi", "Describe a snowy weekend in two sentences.", "Go"]


def attach_trainer(module, precision=None, strategy=None):
    """The few trainer attributes configure_optimizers and on_before_optimizer_step read."""
    module._trainer = SimpleNamespace(precision_plugin=precision or Precision(), strategy=strategy or SimpleNamespace())
    return module


# ------------------------------------------------------------------ one optimizer, parameter groups
@pytest.mark.parametrize("optimizers", ["separate", "shared"])
def test_one_grouped_adamw_steps_as_one_adamw_per_model(optimizers):
    """Three steps of the grouped AdamW (lr, critic_lr and weight decay per group, clipped in
    on_before_optimizer_step) leave every weight bit-identical to the two-optimizer update the
    module used before: one AdamW per model, each clipped on its own (``separate``), or one clip
    over both (``shared``). The clip fires: max_grad_norm is below every gradient norm."""
    module = attach_trainer(
        make_module(critic="separate", optim=dict(lr=1e-2, critic_lr=3e-2, weight_decay=0.1, max_grad_norm=0.05, optimizers=optimizers))
    )
    opt = module.configure_optimizers()
    assert [g["name"] for g in opt.param_groups] == ["policy", "critic"]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-2]
    policy = [p for p in module.policy.parameters() if p.requires_grad]
    critic = list(module.critic.parameters())
    twin_policy, twin_critic = copy.deepcopy(policy), copy.deepcopy(critic)
    twins = [
        torch.optim.AdamW(twin_policy, lr=1e-2, weight_decay=0.1, fused=True),
        torch.optim.AdamW(twin_critic, lr=3e-2, weight_decay=0.1, fused=True),
    ]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(policy + critic, twin_policy + twin_critic, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        module.on_before_optimizer_step(opt)
        opt.step()
        if optimizers == "separate":
            norms = [torch.nn.utils.clip_grad_norm_(params, 0.05) for params in (twin_policy, twin_critic)]
        else:
            norms = [torch.nn.utils.clip_grad_norm_(twin_policy + twin_critic, 0.05)]
        assert min(norms) > 0.05  # the clip fired
        for twin in twins:
            twin.step()
    assert all(torch.equal(p, q) for p, q in zip(policy + critic, twin_policy + twin_critic, strict=True))


def test_a_checkpoint_of_two_optimizers_loads_into_the_grouped_one():
    """merge_optimizer_states renumbers the second optimizer's parameters after the first's: the
    grouped AdamW that loads it continues exactly as the two would have."""
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    opts = [torch.optim.AdamW(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.2)]
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = torch.ones_like(p)
    for o in opts:
        o.step()
    merged = checkpoints.merge_optimizer_states([o.state_dict() for o in opts])
    grouped = torch.optim.AdamW([{"params": list(a.parameters()), "lr": 0.1}, {"params": list(b.parameters()), "lr": 0.2}])
    grouped.load_state_dict(merged)
    assert [g["params"] for g in merged["param_groups"]] == [[0, 1], [2, 3]]
    for p in [*a.parameters(), *b.parameters()]:
        owner = opts[0] if any(p is q for q in a.parameters()) else opts[1]
        assert torch.equal(grouped.state[p]["exp_avg"], owner.state[p]["exp_avg"])


# ------------------------------------------------------------------ 16-mixed: unscale, then clip
class StepGradients(Callback):
    """Each optimizer step's gradient norm per parameter group, read once the optimizer has stepped
    with them (after the GradScaler unscaled and the module clipped them): what the update is made
    of. (A pre-step hook would run before Precision's closure, which calls the clipping hook.)"""

    def __init__(self) -> None:
        self.norms: list[list[float]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        def record(optimizer, args, kwargs) -> None:
            self.norms.append([float(torch.nn.utils.get_total_norm([p.grad for p in g["params"]])) for g in optimizer.param_groups])

        trainer.optimizers[0].register_step_post_hook(record)


def test_16_mixed_clips_the_unscaled_gradients_and_updates_the_scaler_once_per_step(tmp_path):
    """A real torch GradScaler (init scale 2^16) on CPU fp16 autocast: the gradients the optimizer
    steps with have the norms of the 32-true run's (to fp16 rounding), clipped to max_grad_norm
    where that run clips (the policy group, 1.3 > 0.5) and not where it does not (the critic's
    0.05): clipping the scaled gradients would leave 0.5 / 65536. The scaler's growth tracker
    counts one update per optimizer step (two optimizers updated it twice)."""
    norms, scaler = {}, torch.amp.GradScaler("cpu")
    for name, plugins in (("32-true", []), ("16-mixed", [MixedPrecision("16-mixed", "cpu", scaler)])):
        recorder = StepGradients()
        module = make_module(critic="separate", ppo=dict(epochs=1, num_minibatches=2), optim=dict(max_grad_norm=0.5))
        fit(module, tmp_path, iterations=2, callbacks=[recorder], plugins=plugins)
        norms[name] = torch.tensor(recorder.norms)
    assert norms["16-mixed"].shape == (4, 2)
    assert torch.allclose(norms["16-mixed"][:, 0], torch.full((4,), 0.5), rtol=1e-5)  # the policy: clipped
    assert torch.allclose(norms["32-true"][:, 0], torch.full((4,), 0.5), rtol=1e-5)
    assert norms["32-true"][:, 1].max() < 0.5  # the critic: not clipped, the same norms
    torch.testing.assert_close(norms["16-mixed"][:, 1], norms["32-true"][:, 1], rtol=2e-2, atol=0)
    assert scaler.get_scale() == 2.0**16 and scaler._get_growth_tracker() == 4


# ------------------------------------------------------------------ DeepSpeed
def test_deepspeed_config_takes_max_grad_norm_and_refuses_what_cannot_work():
    config = {"zero_optimization": {"stage": 2}}
    gpu.configure_deepspeed(config, 1.0, 1)
    assert config["gradient_clipping"] == 1.0
    gpu.configure_deepspeed(config, 1.0, 1)  # the same value again (a second fit) is no conflict
    none = {}
    gpu.configure_deepspeed(none, None, 1)
    assert none["gradient_clipping"] == 0.0
    with pytest.raises(
        ConfigError, match=r"the DeepSpeed config's gradient_clipping must be unset or model.optim.max_grad_norm \(1.0\), got 0.3"
    ):
        gpu.configure_deepspeed({"gradient_clipping": 0.3}, 1.0, 1)
    with pytest.raises(ConfigError, match=r"trainer.strategy must be DeepSpeed ZeRO stage 0, 1 or 2 .*got 'deepspeed stage 3'"):
        gpu.configure_deepspeed({"zero_optimization": {"stage": 3}}, 1.0, 1)
    with pytest.raises(ConfigError, match=r"model.ppo.gradient_accumulation_steps must be 1 under DeepSpeed"):
        gpu.configure_deepspeed({}, 1.0, 2)


def test_under_deepspeed_the_module_leaves_clipping_to_deepspeed():
    DeepSpeedStrategy = type("DeepSpeedStrategy", (), {})
    module = attach_trainer(make_module(optim=dict(max_grad_norm=1e-3)), strategy=DeepSpeedStrategy())
    assert gpu.is_deepspeed(module.trainer.strategy) and not gpu.is_deepspeed(SimpleNamespace())
    opt = module.configure_optimizers()
    for p in module.policy.parameters():
        p.grad = torch.ones_like(p)
    module.on_before_optimizer_step(opt)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in module.policy.parameters())


# ------------------------------------------------------------------ bf16-true LoRA merges
def test_merging_into_a_bf16_base_gives_the_base_back_bit_for_bit():
    """W + BA - BA in bf16 moves W (checked: the test would see it); merged_adapter restores the
    copy instead, and samples from the merged weights meanwhile."""
    module = make_module(lora=dict(rank=4))
    module.policy.to(torch.bfloat16)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    base = {n: p.detach().clone() for n, p in module.policy.named_parameters() if ".base_layer." in n}
    with merged_adapter(module.policy):
        assert any(not torch.equal(p, base[n]) for n, p in module.policy.named_parameters() if n in base)
    assert all(torch.equal(p, base[n]) for n, p in module.policy.named_parameters() if n in base)
    module.policy.merge_adapter()
    module.policy.unmerge_adapter()  # what peft alone does
    assert any(not torch.equal(p, base[n]) for n, p in module.policy.named_parameters() if n in base)


class FrozenBase(Callback):
    """The frozen base weights and the reference's logits on fixed prompts after Lightning's
    precision conversion (fit start) and at the end of the run."""

    def __init__(self) -> None:
        self.snapshots: list[tuple[dict, torch.Tensor]] = []

    def snapshot(self, module) -> None:
        base = {n: p.detach().clone() for n, p in module.policy.named_parameters() if not p.requires_grad}
        enc = module.sampler.encode(PROMPTS)
        with torch.no_grad(), module.networks.reference() as ref:
            logits = module.networks.response_logits(ref, enc["input_ids"], enc["attention_mask"], 4)
        self.snapshots.append((base, logits))

    def on_train_start(self, trainer, pl_module) -> None:
        self.snapshot(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.snapshot(pl_module)


def test_bf16_true_lora_keeps_the_base_and_the_reference_bit_identical(tmp_path):
    """configs/quickstart.yaml's recipe on the tiny model (LoRA, shared critic, adapter merged
    for sampling, 2 epochs x 2 minibatches) under bf16-true for 8 rollouts: the trained adapter
    moves the policy, and the frozen base and the adapter-disabled reference's logits are bit
    for bit those after Lightning's cast. (Issue 33: the former guard read the dtype before the
    cast, and the quickstart's SmolLM2 base moved by 0.37% of its weights in 3 iterations.)"""
    recorder = FrozenBase()
    module = make_module(
        lora=dict(rank=4, alpha=8, merge_for_generation=True), ppo=dict(num_minibatches=2), optim=dict(lr=3e-2), critic="shared"
    )
    _, history = fit(module, tmp_path, iterations=8, callbacks=[recorder], precision="bf16-true")
    (base0, ref0), (base1, ref1) = recorder.snapshots
    assert {p.dtype for p in base0.values()} == {torch.bfloat16}
    assert all(torch.equal(base0[n], base1[n]) for n in base0)
    assert ref0.dtype == torch.float32 and torch.equal(ref0, ref1)
    assert max(history.series("objective/kl")) > 0  # the adapter trained: the policy left the reference


# ------------------------------------------------------------------ bf16-mixed: float32 logits, rewards
def test_bf16_mixed_logits_are_float32_from_the_output_layer():
    """Under bf16 autocast the output layer returns bf16 logits, rounded by up to ~1e-2 here; the
    module's float32 head gives the float32 product of the same hidden states."""
    module = make_module()
    enc = module.sampler.encode(PROMPTS)
    hidden = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = module.policy(**enc).logits
        with float32_head(module.policy, hidden):
            logits = module.policy(**enc).logits
    head = module.policy.get_output_embeddings()
    assert plain.dtype == torch.bfloat16 and logits.dtype == torch.float32
    expected = hidden[0].float() @ head.weight.T
    assert torch.equal(logits, expected)
    assert (plain.float() - expected).abs().max() > 1e-4  # what float32_head removes


def test_float32_head_serves_each_thread_its_own_context():
    """The asynchronous sampler's thread and the trainer's run the reference at once (CI, stop 70:
    the second context to close deleted a ``forward`` already gone). Each thread's context gets its
    own hidden states; a thread with none open gets the plain bf16 layer; the last to close restores it."""
    module = make_module()
    enc = module.sampler.encode(PROMPTS)
    head = module.policy.get_output_embeddings()
    opened, closed, results = threading.Barrier(2), threading.Barrier(2), {}

    def run(name: str, open_context: bool):
        hidden = []
        context = float32_head(module.policy, hidden) if open_context else contextlib.nullcontext()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), context:
            opened.wait(timeout=60)  # both threads inside: the layer is replaced for both
            results[name] = (module.policy(**enc).logits, hidden)
            closed.wait(timeout=60)
        if name == "first":  # one context closed, the other still open
            results["between"] = "forward" in vars(head)

    threads = [threading.Thread(target=run, args=args) for args in (("first", True), ("plain", False))]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    logits, hidden = results["first"]
    assert logits.dtype == torch.float32 and torch.equal(logits, hidden[0].float() @ head.weight.T)
    assert results["plain"][0].dtype == torch.bfloat16 and results["plain"][1] == []
    assert "forward" not in vars(head)
    # two contexts on one layer from two threads, closed in either order
    both = threading.Barrier(2)

    def nested(hidden):
        with torch.no_grad(), float32_head(module.policy, hidden):
            both.wait(timeout=60)
            module.policy(**enc)
            both.wait(timeout=60)

    lists = [[], []]
    threads = [threading.Thread(target=nested, args=(lst,)) for lst in lists]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert [len(lst) for lst in lists] == [1, 1] and "forward" not in vars(head)


def test_bf16_mixed_first_ratio_is_one_and_rewards_score_outside_autocast(tmp_path, monkeypatch):
    """bf16-mixed, one epoch of one minibatch, old_logprobs from a forward: the first (and only)
    minibatch's ratio is 1 (approxkl ~ 0, no clipping; this held before too: both passes rounded
    alike; the sampler's gap is measured in docs/distributed.md#gpus), the log-probs are float32,
    and the reward backend is called with autocast off (it was called inside the step's autocast)."""
    module = make_module(ppo=dict(epochs=1, num_minibatches=1), sampling=dict(old_logprobs="forward"), critic="separate")
    autocast_at_scoring = []
    checked_scores = module.reward_model.checked_scores

    def record(*args, **kwargs):
        autocast_at_scoring.append(torch.is_autocast_enabled("cpu"))
        return checked_scores(*args, **kwargs)

    monkeypatch.setattr(module.reward_model, "checked_scores", record)
    _, history = fit(module, tmp_path, iterations=2, precision="bf16-mixed")
    assert autocast_at_scoring == [False, False]
    for row in history.rows:
        assert row["policy/approxkl"] < 1e-6 and row["policy/clipfrac"] == 0
    assert history.outputs[0]["rollout"].old_logprobs.dtype == torch.float32


# ------------------------------------------------------------------ rollout memory
class LiveBytes(TorchDispatchMode):
    """Peak bytes of the CPU tensors that ops create inside it and that are still referenced
    (storages counted once, freed when their last tensor dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = self.peak = 0

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.size.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr():
                key = t.untyped_storage().data_ptr()
                if key not in self.refs:
                    self.refs[key], self.size[key] = 0, t.untyped_storage().nbytes()
                    self.live += self.size[key]
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._drop, key)
        return out


def test_rollout_memory_is_a_few_logits_tensors_and_no_layer_but_the_last(smollm2_tokenizer, monkeypatch):
    """A tiny trunk on SmolLM2's 49152-token vocabulary (the output layer is most of the model:
    24 MB) with a shared critic and the sampler's log-probs: everything the rollout allocates
    peaks at 4 float32 (batch, response, vocab) tensors (the stacked logits, and log_softmax,
    exp and product for the entropy; the per-step logits are freed once stacked; before: 5), and
    generate keeps no hidden states but the last layer's."""
    module = make_module(
        tokenizer="smollm2", tiny_config={"hidden_size": 32, "intermediate_size": 64}, sampling=dict(max_new_tokens=16), critic="shared"
    )
    generate = type(module.policy).generate
    calls = []

    def recording_generate(self, *args, **kwargs):
        calls.append(kwargs)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(type(module.policy), "generate", recording_generate)
    with LiveBytes() as memory:
        rollout = module.rollout(PROMPTS * 2)
    assert not any(call.get("output_hidden_states") for call in calls)
    batch, response_len = rollout.responses.shape
    logits_bytes = batch * response_len * len(module.tokenizer) * 4
    model_bytes = sum(p.numel() * 4 for p in module.parameters())
    print(f"rollout peak {memory.peak / 2**20:.1f} MB, logits {logits_bytes / 2**20:.1f} MB, model {model_bytes / 2**20:.1f} MB")
    assert response_len == 16 and memory.peak <= 4.05 * logits_bytes
    assert memory.peak <= 4.05 * model_bytes


# ------------------------------------------------------------------ RNG, CPU fallback
def test_rng_state_of_another_gpu_count_restores_this_ranks_gpu(monkeypatch):
    """An older checkpoint's list of 8 GPU states (rank 0 saw 8) resumes on one GPU, cuda:1 of a
    SLURM task: its first state (rank 0's own GPU) goes to this rank's device, nothing raises; a
    new checkpoint's single state goes there as is; a CPU run ignores them."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((state, device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.full((16,), device.index or 0, dtype=torch.uint8))
    base = {"torch": torch.get_rng_state(), "python": random.getstate()}
    old = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    checkpoints.set_rng_states({**base, "cuda": old}, torch.device("cuda", 1))
    saved = checkpoints._rng_states(torch.device("cuda", 3))
    checkpoints.set_rng_states(saved, torch.device("cuda", 0))
    checkpoints.set_rng_states({**base, "cuda": old}, torch.device("cpu"))
    assert [(int(state[0]), str(device)) for state, device in calls] == [(0, "cuda:1"), (3, "cuda:0")]
    assert "cuda" not in checkpoints._rng_states(torch.device("cpu"))


def test_a_gpu_host_training_on_its_cpu_says_so(monkeypatch):
    """A CPU build of torch on a GPU host warns; no GPU, or a torch that sees it (Lightning warns
    then), does not."""
    monkeypatch.setattr(gpu, "cuda_host", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.warns(
        UserWarning, match=r"training on the CPU, but this machine has an NVIDIA GPU \(this torch build has no CUDA.*setup.sh --cuda"
    ):
        gpu.warn_cpu_fallback(torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        gpu.warn_cpu_fallback(torch.device("cpu"))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(gpu, "cuda_host", lambda: False)
        gpu.warn_cpu_fallback(torch.device("cpu"))


def test_start_up_sets_matmul_precision_and_warns_of_the_16_bit_sampler_ratio(monkeypatch):
    def settings(matmul_precision):  # the module's groups that gpu.setup reads
        return SimpleNamespace(sampling=SamplingArgs(old_logprobs="sampler"), runtime=RuntimeArgs(matmul_precision=matmul_precision))

    calls = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    for precision in ("high", None):
        gpu.setup(trainer, settings(matmul_precision=precision))
    assert calls == ["high"]
    trainer.precision = "bf16-mixed"
    with pytest.warns(
        UserWarning,
        match=r"trainer.precision=bf16-mixed with model.sampling.old_logprobs=sampler: .* model.sampling.old_logprobs=forward makes it 1",
    ):
        gpu.setup(trainer, settings(matmul_precision=None))
    with pytest.raises(ConfigError, match=r"model.runtime.matmul_precision must be highest, high, medium or null, got 'fast'"):
        make_module(runtime=dict(matmul_precision="fast"))
