"""CPU performance: linear layers through oneDNN (``cpu.linear``) and a glibc ``malloc``
that keeps freed memory (``cpu.malloc``). The command's ``cpu`` section (:class:`CPUSettings`)
installs them on the trainer (:func:`apply_cpu_settings`); from Python, call that on a Trainer.

**oneDNN linear.** On a CPU, PyTorch runs every fp32 ``linear`` (and the two products of its
backward) as an MKL sgemm. MKL runs its AVX-512 kernels only on Intel processors: on others
(AMD's EPYC, say) it takes its AVX2 path and tops out near the AVX2 FMA peak. oneDNN, built
into every x86 PyTorch and what ``torch.compile``'s CPU backend calls for linear layers, runs
AVX-512 where the CPU has it (measured: docs/performance.md). :func:`onednn_linear` is a
torch function mode: inside it each ``F.linear`` on plain CPU fp32 tensors runs as
:class:`OneDNNLinear`; anything else (a GPU, bf16, a DTensor or other tensor subclass) runs as
it would have. Results equal MKL's to float rounding (``tests/test_cpu.py`` checks them against
float64), so trajectories differ from an ``aten`` run's at rounding level; each kernel is
deterministic for a given shape and thread count.

**malloc.** glibc hands every allocation above a (moving) threshold of 128 KB-32 MB to ``mmap``
and returns it on free, and trims the heap top: a training step's tensors (activations,
gradients, AdamW's temporaries, 1-100 MB each) then come back as fresh pages, each first write
a page fault. :func:`tune_malloc` raises the threshold to glibc's maximum (32 MB), turns ``mmap``
off (``M_MMAP_MAX`` 0: a tensor above 32 MB, such as the full-vocabulary logits of 32 x 32 tokens,
200 MB, comes from the heap too; glibc still maps memory when the heap cannot grow), stops trimming
and pads heap growth, so freed memory is reused in place: far fewer page faults per PPO update.
A fault costs most on a virtual machine that backs guest memory lazily (docs/performance.md has
the counts and costs). This is PyTorch's CPU tuning advice (jemalloc or tcmalloc) done with the
allocator already loaded. The process keeps its peak heap instead of returning it to the system.

**Threads.** Intra-op threads split each product across cores and meet at a barrier after it: on
a core another job holds, one thread is descheduled and the others wait for it, spinning. With
``cpu.threads`` null the command takes the cores this process may use less those the 1-minute load
says other jobs hold (:func:`choose_threads`), and asks the OpenMP runtime to let idle threads sleep
instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, :func:`set_passive_wait`). ``cpu.threads``,
``OMP_NUM_THREADS`` or a wait policy in the environment (:data:`WAIT_POLICY_ENV`) override either.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from rlhf_lightning.checks import require
from rlhf_lightning.threads import (  # noqa: F401 (re-exported: the command reads them before torch loads, from threads.py)
    WAIT_POLICY_ENV,
    ThreadChoice,
    available_cores,
    choose_threads,
    machine_threads,
    set_passive_wait,
    wait_policy,
)

CpuLinear = Literal["auto", "onednn", "aten"]
_PLAIN = (Tensor, torch.nn.Parameter)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op (x86 and most arm64 builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x (M, in) @ weight (out, in)^T + bias, one oneDNN inner product (the op inductor emits)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b through oneDNN; backward dx = dy W and dW = dy^T x through oneDNN too,
    db = sum dy. Only the gradients that are needed are computed (a frozen LoRA base: dx only)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return linear(x2d, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x2d, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = linear(grad2d, weight.t()).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            dw = linear(grad2d.t(), x2d.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad2d.sum(0)
        return dx, dw, db


def _eligible(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Plain CPU fp32 tensors outside autocast (which would run the product in bf16)."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        not torch.is_autocast_enabled("cpu")
        and all(type(t) in _PLAIN and t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.dim() >= 1
        and x.numel() > 0
        and (bias is None or bias.is_contiguous())
    )


def _linear_arguments(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> tuple:
    return input, weight, bias  # F.linear's signature, however the call spelled it


class _OneDNNLinearMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_arguments(*args, **kwargs)
            if _eligible(x, weight, bias):
                return OneDNNLinear.apply(x, weight, bias)
        return func(*args, **kwargs)


def onednn_route_active() -> bool:
    """Whether ``F.linear`` calls here run through oneDNN (inside :func:`onednn_linear`)."""
    return any(isinstance(mode, _OneDNNLinearMode) for mode in _get_current_function_mode_stack())


VOCAB_CHUNK = 1024  # output-layer rows per product in :func:`output_layer`


def output_layer(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for a language model's output layer. On a CPU without autograd and outside
    the oneDNN route it runs as products of ``VOCAB_CHUNK`` vocabulary rows each. MKL's AVX2 path runs a
    large output layer (SmolLM2's 49152 x 576) faster in such chunks than as one product, with the very same
    values (each output is the same dot product over the hidden size); a decode step samples from these
    logits. oneDNN's product gains nothing from chunks, and the backward of a chunked product would be many
    small ones. The timings are in docs/performance.md ("The output layer in vocabulary chunks")."""
    rows = weight.shape[0]
    if torch.is_grad_enabled() or x.device.type != "cpu" or rows <= 2 * VOCAB_CHUNK or onednn_route_active():
        return F.linear(x, weight, bias)
    out = x.new_empty(*x.shape[:-1], rows)
    for start in range(0, rows, VOCAB_CHUNK):
        part = slice(start, start + VOCAB_CHUNK)
        out[..., part] = F.linear(x, weight[part], None if bias is None else bias[part])
    return out


def resolve_cpu_linear(choice: CpuLinear) -> Literal["onednn", "aten"]:
    """``auto`` is oneDNN where this torch build has it and ATen dispatches AVX-512 kernels (the CPU has
    AVX-512 and ``ATEN_CPU_CAPABILITY`` does not cap it), unless the CPU runs AVX-512 at AVX2's width; else
    aten. Without AVX-512 oneDNN's forward products are no faster than MKL's and its backward ones are
    slower, so the update is slower through them. On AMD's Zen 4, whose AVX-512 is two 256-bit halves, oneDNN's
    AVX-512 gains nothing over MKL's AVX2 path and its route costs time. On a Zen 5, with AVX-512 at full
    width, oneDNN's products are much faster than MKL's. The measurements are in docs/performance.md."""
    if choice == "auto":
        avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        return "onednn" if onednn_available() and avx512 and not half_width_avx512() else "aten"
    return choice


def half_width_avx512(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU executes AVX-512 at AVX2's width: an AMD processor of family 25 (Zen 4; Zen 3 of that
    family has no AVX-512). False where ``cpuinfo`` cannot be read (not Linux)."""
    try:
        with open(cpuinfo) as f:
            head = f.read(4096)
    except OSError:
        return False
    family = re.search(r"^cpu family\s*:\s*(\d+)", head, re.MULTILINE)
    return "AuthenticAMD" in head and family is not None and int(family.group(1)) == 25


def onednn_linear(enabled: bool = True):
    """Context in which CPU fp32 ``F.linear`` calls run through oneDNN (a no-op when not ``enabled``)."""
    return _OneDNNLinearMode() if enabled else contextlib.nullcontext()


class OneDNNPrecision(Precision):
    """Lightning's full-precision plugin (``32-true``) whose step contexts (training, validation,
    test, predict: Lightning enters them around each ``*_step``) run CPU fp32 linear layers
    through oneDNN: every model's, the reward backend's too."""

    def forward_context(self):
        return onednn_linear()


THREADS_PER_CORE = 8  # the most threads per core cpu.threads may ask for


@dataclass(frozen=True)
class CPUSettings:
    """The command's ``cpu`` section: the kernels and allocator of a run on a CPU (ignored on a GPU)."""

    linear: CpuLinear = "auto"
    """The kernel of fp32 linear layers: ``onednn``, ``aten`` (MKL), or ``auto`` (oneDNN where the CPU
    runs AVX-512 at full width, :func:`resolve_cpu_linear`); results agree to float rounding."""
    malloc: Literal["tuned", "default"] = "tuned"
    """``tuned``: glibc keeps freed memory for reuse (:func:`tune_malloc`); ``default``: glibc's own policy."""
    threads: Optional[int] = None
    """torch's intra-op threads per process. Null: ``OMP_NUM_THREADS`` where the environment sets it, else
    the command chooses from the cores this process may use and the 1-minute load (:func:`choose_threads`);
    from Python, null leaves torch's setting as it is."""

    def __post_init__(self) -> None:
        most = THREADS_PER_CORE * available_cores()  # far past it the OpenMP runtime crashes (100000: a segmentation fault)
        require(
            self.threads is None or (isinstance(self.threads, int) and not isinstance(self.threads, bool) and 1 <= self.threads <= most),
            "cpu.threads",
            f"null or an integer in [1, {most}] ({THREADS_PER_CORE} x the {available_cores()} cores this process may use: more threads "
            "than cores only wait on each other)",
            self.threads,
        )
        require(
            self.linear in ("auto", "aten") or (self.linear == "onednn" and onednn_available()),
            "cpu.linear",
            "'auto', 'aten', or 'onednn' where this torch build has oneDNN",
            self.linear,
        )
        require(self.malloc in ("tuned", "default"), "cpu.malloc", "'tuned' or 'default'", self.malloc)


def apply_cpu_settings(trainer, settings: CPUSettings) -> None:
    """``settings`` for ``trainer``'s run: ``cpu.threads`` where set; on a CPU, tune malloc, and in full precision swap the
    strategy's precision plugin for :class:`OneDNNPrecision`. Other precisions keep their plugin:
    oneDNN's route only serves plain fp32 outside autocast."""
    strategy = trainer.strategy
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    if settings.malloc == "tuned" and strategy.root_device.type == "cpu":
        tune_malloc()
    if type(strategy.precision_plugin) is Precision and uses_onednn(strategy.root_device, settings.linear):
        strategy.precision_plugin = OneDNNPrecision()


def uses_onednn(device: torch.device, cpu_linear: CpuLinear) -> bool:
    """Whether ``cpu.linear`` routes fp32 linear layers on ``device`` through oneDNN."""
    return device.type == "cpu" and resolve_cpu_linear(cpu_linear) == "onednn"


# mallopt(3) parameters; the values are C ints.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4
_MALLOC_TUNING = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 512 << 20))


def tune_malloc() -> bool:
    """Make glibc's malloc keep and reuse freed memory (see the module docstring), for every
    later allocation in this process. False where the C library has no ``mallopt`` (macOS) or
    refuses a setting (musl ignores them all)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in _MALLOC_TUNING)
