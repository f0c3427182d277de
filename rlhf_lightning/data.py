"""Prompt data: any local prompt file (jsonl, json, parquet, csv or txt) read with `datasets`.

Batches are lists of prompt strings; the module renders and tokenizes them, so the data
side never depends on the policy's tokenizer. Under DDP, Lightning adds a distributed
sampler, so each rank draws its own shard of prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lightning import LightningDataModule
from torch.utils.data import DataLoader

DATA_DIR = Path(__file__).parent / "data"
BUILTIN_TRAIN = DATA_DIR / "prompts_train.jsonl"
BUILTIN_VALIDATION = DATA_DIR / "prompts_validation.jsonl"
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".tsv": "csv"}


def load_prompts(path: str | Path, column: str = "prompt", field: str = "data.train_path") -> list[str]:
    """Read the prompt column of a local file; clear errors for a missing, empty or malformed file."""
    from datasets import load_dataset

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{field}: prompt file {str(path)!r} does not exist")
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{field}: unsupported prompt file type {path.suffix!r}; use one of {', '.join(FORMATS)}")
    if path.stat().st_size == 0:
        raise ValueError(f"{field}: prompt file {str(path)!r} is empty")
    kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    dataset = load_dataset(fmt, data_files=str(path), split="train", **kwargs)
    if fmt == "text":
        column = "text"  # a .txt file is one prompt per line
    if column not in dataset.column_names:
        raise ValueError(
            f"{field}: column {column!r} not found in {path.name}; available columns: {', '.join(dataset.column_names)}"
        )
    prompts = [p for p in dataset[column] if isinstance(p, str) and p.strip()]
    if not prompts:
        raise ValueError(f"{field}: prompt file {str(path)!r} has no non-empty prompts in column {column!r}")
    return prompts


class PromptDataModule(LightningDataModule):
    """Prompts for rollouts (train) and for evaluation (validation/test).

    Args:
        train_path: prompt file for training; default: the built-in set of 360 prompts.
        val_path: prompt file for validation and test; default: the built-in 40 held-out prompts.
        prompt_column: column holding the prompt text (ignored for .txt: one prompt per line).
        batch_size: prompts per PPO iteration per process (rollout batch).
        val_batch_size: prompts per evaluation batch.
        shuffle: shuffle training prompts every epoch (seeded by ``seed_everything``).
    """

    def __init__(
        self,
        train_path: Optional[str] = None,
        val_path: Optional[str] = None,
        prompt_column: str = "prompt",
        batch_size: int = 8,
        val_batch_size: int = 16,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("val_batch_size", val_batch_size)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"data.{name} must be an integer >= 1, got {value!r}")
        self.train_path = train_path or str(BUILTIN_TRAIN)
        self.val_path = val_path or str(BUILTIN_VALIDATION)
        self.prompt_column, self.batch_size, self.val_batch_size = prompt_column, batch_size, val_batch_size
        self.shuffle, self.num_workers = shuffle, num_workers
        self.train_prompts: list[str] = []
        self.val_prompts: list[str] = []

    def setup(self, stage: str) -> None:
        if stage == "fit" and not self.train_prompts:
            self.train_prompts = load_prompts(self.train_path, self.prompt_column, "data.train_path")
        if not self.val_prompts:
            self.val_prompts = load_prompts(self.val_path, self.prompt_column, "data.val_path")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_prompts, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True,
            num_workers=self.num_workers, collate_fn=list,
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_prompts, batch_size=self.val_batch_size, num_workers=self.num_workers, collate_fn=list)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
