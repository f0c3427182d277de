"""Sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``) through Lightning's
``ModelParallelStrategy``: what the module needs to shard its models (built empty on the meta
device and filled shard by shard: ``meta_copy``, ``materialise``), sample from them and count
what each rank holds.

Every rank holds 1/world of each sharded parameter (a ``DTensor`` sharded on dim 0) and of its
gradient and AdamW state. A block's full weights exist only while it runs: ``fully_shard``'s
forward pre-hook all-gathers them and its post-hook frees them again (``reshard_after_forward``).
The same code runs on CPU processes (gloo) and GPUs (NCCL).

    rlhf-lightning fit --config configs/tiny.yaml --config configs/fsdp2.yaml --trainer.devices=2
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

# ValueModel returns its values as a view (squeeze); its callers never modify them in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPValueModel\) returned a view tensor")


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` as pure data-parallel sharding (FSDP2, tensor parallel size 1)
    over every process of the run, with gradient accumulation without communication.

    ``ModelParallelStrategy`` wants the data-parallel size as a number (its ``auto`` is the number
    of nodes, meant for tensor parallelism inside a node); this one takes the world size, so one
    YAML serves any ``--trainer.devices``. ``block_backward_sync`` is FSDP2's ``no_sync``: the
    non-final micro-batches of a minibatch keep unsharded gradients and skip the reduce-scatter.

    Args:
        save_distributed_checkpoint: each rank writes its own shards into a checkpoint folder
            (``torch.distributed.checkpoint``); false: gathered into one file on rank 0.
    """

    def __init__(self, save_distributed_checkpoint: bool = True, **kwargs) -> None:
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=save_distributed_checkpoint, **kwargs
        )

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A checkpoint folder written whole or not at all: the shards go to ``<name>.partial``,
        which replaces the folder once every rank has written: a kill during the writes leaves the
        previous checkpoint, as Lightning's single-file saves do (a kill in the instant between
        the two renames leaves it as ``<name>.previous``)."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        partial, previous = path.with_name(path.name + ".partial"), path.with_name(path.name + ".previous")
        if self.global_rank == 0:
            _remove(partial)
        self.barrier()
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()  # every rank's shards are on disk
        if self.global_rank == 0:
            if path.exists():
                os.replace(path, previous)
            os.replace(partial, path)
            _remove(previous)
        self.barrier()

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        roots = fsdp_roots(self.lightning_module)
        for root in roots:
            root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for root in roots:
                root.set_requires_gradient_sync(True)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def is_sharded(model: Optional[nn.Module]) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return model is not None and any(isinstance(m, FSDPModule) for m in model.modules())


def fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The outermost ``fully_shard`` modules inside ``model``."""
    from torch.distributed.fsdp import FSDPModule

    roots, inside = [], set()
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) and not any(name.startswith(p) for p in inside):
            roots.append(module)
            inside.add(name + "." if name else "")
    return roots


def shard(model: nn.Module, mesh, frozen: bool = False) -> nn.Module:
    """``fully_shard`` each transformer block of ``model`` (the classes its Hugging Face config
    declares unsplittable, ``_no_split_modules``: ``LlamaDecoderLayer``, ...), then the root
    (embeddings, final norm, LM or value head). A LoRA adapter's matrices sit inside the blocks'
    linears and are sharded with them; a model without blocks (a value head alone) is one
    unit. The root keeps its parameters gathered after a forward (FSDP2's default for the root:
    backward needs them at once), except in a ``frozen`` model, which never runs backward: there
    every unit frees its gathered weights after its forward."""
    from torch.distributed.fsdp import fully_shard

    block_names = set()
    for module in model.modules():
        block_names.update(getattr(module, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True if frozen else None)
    return model


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory; ties kept), its
    buffers real: the skeleton of a reference or critic that ``materialise`` fills shard by shard."""
    memo = {id(p): nn.Parameter(p.to("meta"), requires_grad=p.requires_grad) for p in model.parameters()}
    return copy.deepcopy(model, memo)


# (name in the source, first row, end row) -> those rows of that full tensor
Rows = Callable[[str, int, int], torch.Tensor]


@torch.no_grad()
def materialise(model: nn.Module, rows: Rows, source_name: Callable[[str], str] = lambda name: name) -> None:
    """Give every parameter of the sharded ``model`` that is still on the meta device its values,
    this rank's rows only: ``rows(source_name(name), start, end)`` reads rows [start, end) of the
    full tensor (FSDP2 shards dim 0 as ``torch.chunk`` does), so no rank ever holds a full model,
    only, at most, one full tensor of it. Parameters and buffers that are already real (LoRA
    adapters, a value head, rotary tables) keep their values."""
    from torch.distributed.tensor import DTensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    tensors = lambda: [*model.named_parameters(), *model.named_buffers()]
    empty = {name for name, t in tensors() if t.is_meta}
    if not empty:
        return
    kept = {name: local(t).clone() for name, t in tensors() if name not in empty}
    device = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh.device_type
    model.to_empty(device=device)  # FSDP2 re-pads each new local shard (FSDPParam.reset_sharded_param)
    for name, t in tensors():
        if name in kept:
            local(t).copy_(kept[name])
            continue
        start, end = _local_rows(t)
        local(t).copy_(rows(source_name(name), start, end))


def _local_rows(t: torch.Tensor) -> tuple[int, int]:
    """The rows [start, end) of dim 0 that this rank holds of ``t`` (all of a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return 0, t.shape[0]
    mesh, n = t.device_mesh, t.shape[0]
    chunk = -(-n // mesh.size())
    start = min(mesh.get_local_rank() * chunk, n)
    end = min(start + chunk, n)
    assert t.to_local().shape[0] == end - start, (t.shape, t.to_local().shape, start, end)
    return start, end


def reshard(*models: Optional[nn.Module]) -> None:
    """Free every gathered weight of ``models``, so their parameters are the local shards again
    (a root keeps its weights gathered after a forward without a backward)."""
    from torch.distributed.fsdp import FSDPModule

    for model in filter(None, models):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Hold ``model``'s full weights for the duration of the block: one all-gather per block on
    entry, none in between (every forward inside finds its block already unsharded), freed on exit.

    This is how the module samples: HF ``generate`` calls the model's forward once per new
    token, and with FSDP2's hooks each call would all-gather every block again (max_new_tokens
    gathers of the whole model per rollout instead of one). The price is the full policy's
    weights in memory while it samples, as an unsharded model would have them all the time.
    Since no collective runs inside, ranks may stop generating at different lengths."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.unshard()
    for m in modules:  # the forward post-hooks must not free what was just gathered
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for m, reshard in zip(modules, _reshard_flags(modules, model), strict=True):
            m.set_reshard_after_forward(reshard, recurse=False)
            m.reshard()


def _reshard_flags(modules: list[nn.Module], model: nn.Module) -> list[bool]:
    """``fully_shard``'s defaults, as ``shard`` leaves them: blocks reshard after forward, the root not."""
    return [m is not model for m in modules]


def local_numel(*models: Optional[nn.Module]) -> int:
    """Parameter elements this rank holds: a sharded parameter counts its local shard (with
    FSDP2's padding of dim 0 to a multiple of the world size), a plain one counts whole."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for model in filter(None, models):
        for p in model.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += (p.to_local() if isinstance(p, DTensor) else p).numel()
    return total


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights of ``model`` on CPU, on every rank (a collective: every rank
    must call it); a model that is not sharded gives its own state dict."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
