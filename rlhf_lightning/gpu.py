"""What the GPU paths ask of the Lightning strategy and the machine, checked at start-up
(``PPORLHF.setup``, before any model loads): DeepSpeed's settings, the float32 matmul precision,
and a warning when a GPU host trains on its CPU. What has run on which machine: docs/distributed.md.

**DeepSpeed.** One optimizer (``configure_optimizers``: parameter groups), so Lightning's
``DeepSpeedStrategy`` accepts the module. DeepSpeed clips gradients inside its own step from its
config's ``gradient_clipping`` (Lightning's clipping does nothing under it): that value is
``model.optim.max_grad_norm``, written into the config here; a config that sets another is refused.
DeepSpeed clips the norm of all parameters together (``optimizers: shared``'s clip). ZeRO stage 3
is refused: its parameters are partitioned outside the forward, and the rollout reads whole
weights outside it (``generate`` would need ``synced_gpus``, the reference check and the reference
moves the gathered weights, the LoRA merge a gathered base); FSDP2 (configs/fsdp2.yaml) shards
parameters instead. ``gradient_accumulation_steps`` > 1 is refused: DeepSpeed's ZeRO engine has no
``no_sync`` for the micro-batches before the last.
"""

from __future__ import annotations

import os
import shutil
from typing import Literal, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn

from rlhf_lightning.checks import require

MatmulPrecision = Literal["highest", "high", "medium"]


def is_deepspeed(strategy) -> bool:
    """Whether ``strategy`` is Lightning's DeepSpeedStrategy (imported only when deepspeed is)."""
    return any(cls.__name__ == "DeepSpeedStrategy" for cls in type(strategy).__mro__)


def configure_deepspeed(config: dict, max_grad_norm: Optional[float], gradient_accumulation_steps: int) -> None:
    """Check a DeepSpeed ``config`` (the strategy's dict) against the module's settings and write
    ``max_grad_norm`` into it as ``gradient_clipping`` (0: no clipping)."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    require(
        stage in (0, 1, 2),
        "trainer.strategy",
        "DeepSpeed ZeRO stage 0, 1 or 2 (stage 3: use configs/fsdp2.yaml)",
        f"deepspeed stage {stage}",
    )
    require(
        gradient_accumulation_steps == 1,
        "model.ppo.gradient_accumulation_steps",
        "1 under DeepSpeed (no no_sync in ZeRO; raise num_minibatches or lower the batch instead)",
        gradient_accumulation_steps,
    )
    clip = float(max_grad_norm or 0.0)
    configured = config.get("gradient_clipping")
    require(
        configured in (None, clip),
        "the DeepSpeed config's gradient_clipping",
        f"unset or model.optim.max_grad_norm ({clip})",
        configured,
    )
    config["gradient_clipping"] = clip


def no_autocast(device: torch.device):
    """The reward models score outside the policy's autocast (bf16-mixed, 16-mixed): in their own
    precision, as they would outside training."""
    return torch.autocast(device.type, enabled=False)


def cuda_host() -> bool:
    """Whether this machine has an NVIDIA GPU, whatever torch build is installed: ``nvidia-smi`` on
    the PATH or a ``/dev/nvidia0`` device."""
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")


def warn_cpu_fallback(device: torch.device) -> None:
    """A run on the CPU of a machine with an NVIDIA GPU that torch cannot use says so: with a CPU
    build of torch (``tools/setup.sh --cpu``), or a CUDA build the driver does not serve,
    ``accelerator: auto`` picks the CPU without a word (where torch sees the GPU, Lightning itself
    warns that it is not used)."""
    if device.type != "cpu" or torch.cuda.is_available() or not cuda_host():
        return
    why = "this torch build has no CUDA" if torch.version.cuda is None else f"torch's CUDA {torch.version.cuda} sees no GPU: the driver?"
    rank_zero_warn(
        f"training on the CPU, but this machine has an NVIDIA GPU ({why}: torch {torch.__version__}); "
        "install the CUDA build with tools/setup.sh --cuda"
    )


def setup(trainer, module) -> None:
    """The start-up checks and settings of ``module`` (a PPORLHF) for ``trainer``'s strategy and device."""
    strategy = trainer.strategy
    if is_deepspeed(strategy):
        optim = module.optim
        configure_deepspeed(strategy.config, optim.max_grad_norm, module.ppo.gradient_accumulation_steps)
        if optim.max_grad_norm and optim.optimizers == "separate" and module.hparams.critic != "none":
            rank_zero_warn("DeepSpeed clips the joint gradient norm of the policy and the critic (model.optim.optimizers: shared's clip)")
    precision = str(getattr(trainer, "precision", "32-true"))
    if module.sampling.old_logprobs == "sampler" and precision.startswith(("bf16", "16")):
        rank_zero_warn(
            f"trainer.precision={precision} with model.sampling.old_logprobs=sampler: the sampler's cached decode and a forward round "
            "differently in 16 bits, so the first PPO ratio is not exactly 1; model.sampling.old_logprobs=forward makes it 1"
        )
    if module.runtime.matmul_precision is not None:
        torch.set_float32_matmul_precision(module.runtime.matmul_precision)
    warn_cpu_fallback(strategy.root_device)
