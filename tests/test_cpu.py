"""cpu.py: oneDNN linear layers against F.linear (values and every gradient, and the cases that
must fall through to PyTorch's own kernel), and the tuned malloc's reuse of freed memory."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rlhf_lightning import cpu

needs_onednn = pytest.mark.skipif(not cpu.onednn_available(), reason="this torch build has no oneDNN")


def _routed(y: torch.Tensor) -> bool:
    return type(y.grad_fn).__name__ == "OneDNNLinearBackward"


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48), (48,)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_and_gradients_match_f_linear(shape, with_bias):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    weight, bias = torch.randn(24, 48, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    grad_out = torch.randn(*shape[:-1], 24, dtype=torch.float64)
    inputs = [t.float().requires_grad_(True) for t in (x, weight, bias if with_bias else None) if t is not None]
    with cpu.onednn_linear():
        y = F.linear(*inputs)
    y.backward(grad_out.float())
    assert _routed(y)
    # Against float64 (exact to ~1e-15): y = x W^T + b, dx = dy W, dW = dy^T x (summed over rows), db = sum dy.
    x2, g2 = x.reshape(-1, 48), grad_out.reshape(-1, 24)
    expected = [g2 @ weight, g2.T @ x2] + ([g2.sum(0)] if with_bias else [])
    expected_y = x @ weight.T + (bias if with_bias else 0)
    torch.testing.assert_close(y.double(), expected_y, rtol=1e-5, atol=1e-5)
    for got, want in zip([t.grad.reshape(want.shape) for t, want in zip(inputs, expected, strict=True)], expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_frozen_weight_gets_no_gradient_and_input_gradient_is_right():
    torch.manual_seed(1)
    layer = torch.nn.Linear(32, 16, bias=False).requires_grad_(False)
    x = torch.randn(4, 32, requires_grad=True)
    with cpu.onednn_linear():
        y = layer(x)
    y.sum().backward()
    assert _routed(y) and layer.weight.grad is None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(4, 32), rtol=1e-5, atol=1e-6)  # d(sum y)/dx = 1^T W


@needs_onednn
def test_not_routed_outside_the_context_or_when_disabled_or_not_cpu_fp32():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    bf16 = torch.nn.Linear(8, 4).to(torch.bfloat16)
    expected_bf16 = F.linear(x.to(torch.bfloat16), bf16.weight, bf16.bias)  # PyTorch's own kernel, outside the context
    assert not _routed(layer(x))
    with cpu.onednn_linear(enabled=False):
        assert not _routed(layer(x))
    with cpu.onednn_linear():
        assert _routed(layer(x))
        y = bf16(x.to(torch.bfloat16))  # bf16: PyTorch's kernel, bit for bit
        assert not _routed(y)
        assert torch.equal(y, expected_bf16)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 tensors, but autocast runs the product in bf16
            y = layer.float()(x)
        assert not _routed(y) and y.dtype == torch.bfloat16


@needs_onednn
def test_tiny_llama_under_onednn_matches_aten():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    )
    ids = torch.randint(0, 50, (3, 9))
    expected = model(input_ids=ids).logits
    expected.logsumexp(-1).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with cpu.onednn_linear():
        logits = model(input_ids=ids).logits
        logits.logsumexp(-1).sum().backward()
    assert _routed(logits)  # the LM head's product, the last op
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], rtol=1e-3, atol=1e-5, msg=name)


@needs_onednn
def test_output_layer_runs_the_vocabulary_in_chunks_only_without_autograd_outside_onednn():
    """cpu.output_layer: without autograd on a CPU, one product per VOCAB_CHUNK rows of the output layer, whose
    values are the single product's (to float rounding); with autograd, inside the oneDNN route or for a layer
    of at most two chunks, one F.linear."""
    from torch.overrides import TorchFunctionMode

    class CountLinear(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += func is F.linear
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(3 * cpu.VOCAB_CHUNK + 5, 16, generator=generator), torch.randn(3 * cpu.VOCAB_CHUNK + 5, generator=generator)
    x = torch.randn(2, 3, 16, generator=generator)
    with torch.no_grad(), CountLinear() as count:
        out = cpu.output_layer(x, weight, bias)
    assert count.calls == 4
    torch.testing.assert_close(out, F.linear(x, weight, bias))
    with CountLinear() as count:
        trained = cpu.output_layer(x.clone().requires_grad_(), weight, bias)
    assert count.calls == 1 and trained.requires_grad
    with torch.no_grad(), CountLinear() as count:
        cpu.output_layer(x, weight[: 2 * cpu.VOCAB_CHUNK])
    assert count.calls == 1
    if cpu.onednn_available():
        with torch.no_grad(), cpu.onednn_linear(), CountLinear() as count:
            assert cpu.onednn_route_active()
            torch.testing.assert_close(cpu.output_layer(x, weight, bias), out)
        assert count.calls == 1 and not cpu.onednn_route_active()


def test_the_rollout_samples_the_same_with_the_output_layer_in_chunks(monkeypatch):
    """The hf engine's decode with the output layer in chunks of 8 vocabulary rows draws the very tokens, and
    records the logits, of the same decode with one product per step (the tiny model's vocabulary: 13 chunks)."""
    from helpers import make_module

    module = make_module(sampling=dict(max_new_tokens=6, min_new_tokens=6))
    module.configure_model()
    enc = module.sampler.encode(["abc", "hello", "xyz", "q"])
    samples = {}
    for chunk in (10**9, 8):
        monkeypatch.setattr(cpu, "VOCAB_CHUNK", chunk)
        samples[chunk] = module.rollout_engine.sample(module.sampler, enc, seed=3)
    assert module.policy.get_output_embeddings().weight.shape[0] > 2 * 8
    assert torch.equal(samples[8].sequences, samples[10**9].sequences)
    torch.testing.assert_close(samples[8].logits, samples[10**9].logits)


def test_auto_resolves_to_onednn_where_aten_dispatches_full_width_avx512_else_to_aten(monkeypatch):
    for capability, half_width, kernel in (
        ("AVX512", False, "onednn"),
        ("AVX512", True, "aten"),
        ("AVX2", False, "aten"),
        ("DEFAULT", False, "aten"),
    ):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        monkeypatch.setattr(cpu, "half_width_avx512", lambda half_width=half_width: half_width)
        assert cpu.resolve_cpu_linear("auto") == kernel, (capability, half_width)
        assert cpu.resolve_cpu_linear("onednn") == "onednn" and cpu.resolve_cpu_linear("aten") == "aten"


def test_half_width_avx512_is_amd_family_25_only(tmp_path):
    """Zen 4 (AuthenticAMD, cpu family 25) runs AVX-512 as two 256-bit halves; Zen 5 (26) and Intel do not; an
    unreadable file (not Linux) says False."""

    def cpuinfo(vendor, family):
        path = tmp_path / f"{vendor}{family}"
        path.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 17\n")
        return str(path)

    assert cpu.half_width_avx512(cpuinfo("AuthenticAMD", 25))
    assert not cpu.half_width_avx512(cpuinfo("AuthenticAMD", 26))
    assert not cpu.half_width_avx512(cpuinfo("GenuineIntel", 6))
    assert not cpu.half_width_avx512(str(tmp_path / "missing"))


_STEPS = """
import ctypes, sys, torch
from rlhf_lightning import cpu

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert cpu.tune_malloc()
before, mmapped = mallinfo2().hblkhd, 0
for _ in range(3):
    for mb in (1, 3, 8, 20, 200):  # a training step's tensors, up to the full-vocabulary logits of 32 x 32 tokens
        y = torch.ones(mb << 18) * 2
        mmapped = max(mmapped, mallinfo2().hblkhd - before)
        del y
print(mmapped >> 20, mallinfo2().fordblks >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_tuned_malloc_serves_step_sized_tensors_from_the_heap_and_keeps_them_freed_there():
    """Rounds of 1-200 MB tensors made and freed, glibc's own counters (mallinfo2) read between:
    with its own settings glibc hands the 20 and 200 MB tensors to a fresh mmap (returned to the
    system on free, so its pages fault in again next time); tuned, no tensor is mmapped, not even one
    above the largest mmap threshold glibc accepts (32 MB), and the freed memory stays in the heap,
    free for the next step (the memory behind docs/performance.md's fault counts).
    Page faults themselves are not counted here: on these virtual machines they varied from run to
    run, in both modes, with what else the machine did (2026-11-27)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    (default_mmapped, _), (tuned_mmapped, tuned_free) = (
        map(int, subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, env=env, check=True).stdout.split())
        for mode in ("default", "tuned")
    )
    assert default_mmapped >= 200, default_mmapped  # MB: the 200 MB tensor, mmapped
    assert tuned_mmapped == 0 and tuned_free >= 200, (tuned_mmapped, tuned_free)


def test_unknown_kernel_and_malloc_choices_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"cpu.linear must be 'auto', 'aten', or 'onednn' .*, got 'fast'"):
        cpu.CPUSettings(linear="fast")
    with pytest.raises(ValueError, match=r"cpu.malloc must be 'tuned' or 'default', got 'jemalloc'"):
        cpu.CPUSettings(malloc="jemalloc")


def test_the_module_refuses_its_former_cpu_settings_naming_the_cpu_section():
    from rlhf_lightning.module import PPORLHF

    with pytest.raises(ValueError, match=r"model.cpu_linear moved out of the module: set cpu.linear"):
        PPORLHF(policy="tiny", cpu_linear="aten")


@pytest.mark.parametrize(
    "cpu_linear, precision, routed",
    [("onednn", "32-true", True), ("aten", "32-true", False), ("onednn", "bf16-mixed", False)],
)
def test_the_training_step_runs_its_linear_layers_through_the_chosen_kernel(tmp_path, monkeypatch, cpu_linear, precision, routed):
    """cpu.linear reaches the step through Lightning's precision plugin (cpu.OneDNNPrecision,
    whose context Lightning enters around training_step): with onednn in 32-true every linear of the
    iteration runs as OneDNNLinear, with aten none does, and under bf16-mixed the plugin is
    Lightning's own (oneDNN's route only serves fp32 outside autocast)."""
    if not cpu.onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    from helpers import fit, make_module

    calls = []
    apply = cpu.OneDNNLinear.apply
    monkeypatch.setattr(cpu.OneDNNLinear, "apply", lambda *args: calls.append(1) or apply(*args))
    settings = cpu.CPUSettings(linear=cpu_linear, malloc="default")
    trainer, _ = fit(make_module(ppo=dict(epochs=1)), tmp_path, iterations=1, precision=precision, cpu_settings=settings)
    assert (type(trainer.strategy.precision_plugin) is cpu.OneDNNPrecision) == routed
    assert bool(calls) == routed, len(calls)
