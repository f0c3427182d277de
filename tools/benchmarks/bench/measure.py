"""The benchmark's instruments: a clock per phase, a counter of passes over each model's trunk, this
process's resident memory, and the built-in prompts every run draws (decode_bench and compare_trl use them too)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import resource
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Optional


class PhaseClock:
    """Exclusive wall-clock seconds per named phase: time spent in a nested phase counts for it
    alone. CUDA is synchronised at every boundary so GPU work lands in the phase that queued it.
    With ``memory``, also each phase's peak RSS (MB): at every boundary the peak since the last
    one (VmHWM) goes to the phase that was running, and the peak starts again from the current RSS."""

    def __init__(self, device, memory: bool = False) -> None:
        self.device = device
        self.memory = memory
        self.seconds: dict[str, float] = defaultdict(float)
        self.peaks: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._since = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _switch(self) -> None:
        now = self._now()
        if self._stack:
            self.seconds[self._stack[-1]] += now - self._since
            if self.memory:
                self.peaks[self._stack[-1]] = max(self.peaks[self._stack[-1]], peak_rss_mb())
        if self.memory:
            reset_peak_rss()
        self._since = now

    @contextlib.contextmanager
    def __call__(self, name: str, within: Optional[str] = None):
        """Time ``name``; with ``within``, only when called directly inside that phase."""
        if within is not None and (not self._stack or self._stack[-1] != within):
            yield
            return
        import torch

        self._switch()
        self._stack.append(name)
        try:
            with torch.profiler.record_function(f"bench/{name}"):
                yield
        finally:
            self._switch()
            self._stack.pop()

    def wrap(self, name: str, fn, within: Optional[str] = None):
        def timed(*args, **kwargs):
            with self(name, within):
                return fn(*args, **kwargs)

        return timed

    def take(self) -> dict[str, float]:
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds

    def take_peaks(self) -> dict[str, float]:
        peaks, self.peaks = dict(self.peaks), defaultdict(float)
        return peaks

    @property
    def current(self) -> Optional[str]:
        """The innermost phase running now (None between phases)."""
        return self._stack[-1] if self._stack else None


class PassCounter:
    """Counts the passes over each watched model's trunk, per phase: ``generate`` calls (their
    prefill), decode steps (the other forwards ``generate`` makes, a KV cache in hand), no-grad
    forwards (``fwd``) and forwards with autograd on (``fwd+bwd``: the loop backpropagates every
    one). A forward is one call of the trunk (the decoder stack), or two with ``shared_prompts``
    (rlhf_lightning/prefix.py: the distinct prompts, then the responses on their keys and values,
    counted once), so a LoRA reference (the policy with its adapter off) counts as the policy's
    trunk, told apart by its phase. ``phase()`` names
    the phase a pass lands in; None leaves it uncounted (the floors between iterations)."""

    def __init__(self, phase=lambda: "all") -> None:
        self.phase = phase
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    @staticmethod
    def trunk(model):
        """The decoder stack inside a causal LM, a classifier, a PEFT wrapper or a critic."""
        import torch

        return next(m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList))

    def watch(self, name: str, model) -> None:
        import torch

        def count(module, args, kwargs) -> None:
            phase = self.phase()
            if phase is None:
                return
            cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5 names it cache
            if getattr(cache, "shared_prompts", False):
                return  # responses on their shared prompts' keys and values: the rest of the pass counted at its prompts
            if cache is not None:
                kind = "decode step" if cache.get_seq_length() else "generate"
            else:
                kind = "fwd+bwd" if torch.is_grad_enabled() else "fwd"
            self.counts[phase][f"{name} {kind}"] += 1

        self.trunk(model).register_forward_pre_hook(count, with_kwargs=True)

    def take(self) -> dict[str, dict[str, int]]:
        counts, self.counts = {p: dict(c) for p, c in self.counts.items()}, defaultdict(lambda: defaultdict(int))
        return counts


def quiet() -> None:
    """Keep the output a table: no Lightning banners, progress bars or expected warnings."""
    import transformers

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")  # dataloader workers, eval-mode reference, generation flags


def builtin_prompts(n: int) -> list[str]:
    from rlhf_lightning.data import BUILTIN_TRAIN

    with BUILTIN_TRAIN.open() as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]


def trainable_numel(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad) if model is not None else 0


def peak_rss_mb() -> float:
    """This process's peak resident memory: Linux's VmHWM (getrusage's ru_maxrss would carry over
    the peak of the parent that forked it: this script's own, or rank 0's for the ranks it starts),
    since the process started or since the last ``reset_peak_rss``."""
    return _proc_status_mb("VmHWM:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB (macOS: bytes)


def rss_mb() -> float:
    """This process's resident memory now (Linux; nan elsewhere)."""
    return _proc_status_mb("VmRSS:") or math.nan


def _proc_status_mb(field: str) -> Optional[float]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024  # kB
    return None


def reset_peak_rss() -> bool:
    """Start this process's peak RSS (VmHWM) again from its current RSS (Linux's ``clear_refs``
    5), so that ``peak_rss_mb`` reads the peak of what runs from now on. False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
