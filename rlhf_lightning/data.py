"""Prompt data: any local prompt file (jsonl, json, csv, tsv, txt, or parquet read with `datasets`).

Batches are lists of prompt strings; the module renders and tokenizes them, so the data
side never depends on the policy's tokenizer. Under DDP, Lightning adds a distributed
sampler, so each rank draws its own shard of prompts.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from lightning import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from rlhf_lightning.checks import FLOAT32_RANGE, missing_file
from rlhf_lightning.interfaces import ConfigError, finite_number, require, require_number

PROMPTS_DIR = Path(__file__).parent / "prompts"  # the built-in prompt files (not the module data.py)
BUILTIN_TRAIN = PROMPTS_DIR / "prompts_train.jsonl"
BUILTIN_VALIDATION = PROMPTS_DIR / "prompts_validation.jsonl"
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".tsv": "csv"}


def load_prompts(path: str | Path, column: str = "prompt", field: str = "data.train_path") -> list[str]:
    """Read the prompt column of a local file. Every problem is a ConfigError naming ``field``, the
    file and, where there is one, the line: a missing file or a folder, bytes that are not UTF-8, a
    malformed line, a missing column, a prompt that is not text (never dropped silently), or no
    prompt at all. Blank prompts are skipped."""
    return [prompt for _, prompt, _ in load_prompt_records(path, column, field)]


def load_prompt_records(
    path: str | Path, column: str = "prompt", field: str = "data.train_path", extra: Optional[dict[str, str]] = None
) -> list[tuple[str, str, dict]]:
    """:func:`load_prompts` with each prompt's place in the file (``line 3``) and the values of the ``extra``
    columns, given as {column: the setting that names it}: a column the file lacks is a ConfigError naming
    that setting and the columns there are."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ConfigError(f"{field}: {str(path)!r} is a folder, not a prompt file")
    if not path.is_file():
        raise missing_file(f"{field}: prompt file {str(path)!r} does not exist", path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(f"{field}: unsupported prompt file type {path.suffix!r}; use one of {', '.join(FORMATS)}")
    if path.stat().st_size == 0:
        raise ConfigError(f"{field}: prompt file {str(path)!r} is empty")
    where = f"{field}: prompt file {str(path)!r}"
    if suffix == ".parquet":
        from datasets import load_dataset

        table = load_dataset("parquet", data_files=str(path), split="train")
        records, columns = [(f"row {i + 1}", row) for i, row in enumerate(table)], table.column_names
    else:
        try:
            text = path.read_bytes().decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is no text
        except UnicodeDecodeError as err:
            line = path.read_bytes()[: err.start].count(b"\n") + 1
            raise ConfigError(f"{where} is not valid UTF-8 (line {line}, byte {err.start})") from None
        records, columns = _records(text, suffix, where, column)
    for name, setting in {column: field, **(extra or {})}.items():
        if name not in columns:
            of_file = "" if setting == field else f" ({field})"
            raise ConfigError(f"{setting}: column {name!r} not found in {path.name}{of_file}; available columns: {', '.join(columns)}")
    prompts = []
    for place, record in records:
        prompt = record.get(column)
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}, {place}: the prompt in column {column!r} is {type(prompt).__name__} {prompt!r}, not text")
        if (odd := NOT_TEXT.search(prompt)) is not None:
            raise ConfigError(
                f"{where}, {place}: the prompt in column {column!r} holds {odd.group()!r} at character {odd.start()}, which is no "
                "text (a control character, or half of a UTF-16 pair escaped in JSON): a binary file, or an escape gone wrong?"
            )
        if prompt.strip():
            prompts.append((place, prompt, {name: record.get(name) for name in extra or {}}))
    if not prompts:
        raise ConfigError(f"{field}: prompt file {str(path)!r} has no non-empty prompts in column {column!r}")
    return prompts


# What no prompt text holds: C0 control characters but tab, newline, carriage return, vertical tab and form feed; DEL; and
# lone surrogates (JSON's "\ud800" escapes one half of a UTF-16 pair, which no tokenizer can encode).
NOT_TEXT = re.compile("[\x00-\x08\x0e-\x1f\x7f\ud800-\udfff]")


def prompt_id(prompt: str) -> str:
    """A prompt's id when its file names none: the first 16 hex digits of the SHA-1 of its text (the same
    on every rank, in every run, wherever the prompt sits in the file)."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class PromptTable:
    """The training prompts as a per-prompt controller names them: ``ids`` the distinct prompt ids in file
    order (a prompt's row: its index, the same on every rank, for sums over ranks), ``row_of`` each prompt
    text's row, ``budgets`` each id's KL budget (None without a budget column)."""

    ids: list[str]
    row_of: dict[str, int]
    budgets: Optional[dict[str, float]] = None
    teacher: Optional[dict[str, str]] = None  # each prompt text's teacher prompt (model.prompts.teacher_template)

    @classmethod
    def of(
        cls,
        records: list[tuple[str, str, dict]],
        where: str,
        id_column: Optional[str] = None,
        budget_column: Optional[str] = None,
        teacher_template: Optional[str] = None,
    ):
        """From :func:`load_prompt_records`' (place, prompt, extra) records of the file ``where``: each prompt's id
        (its ``id_column`` value, text or an integer; else :func:`prompt_id`), budget (its ``budget_column``
        value, a finite number > 0; a csv's text is read as one) and teacher prompt (``teacher_template`` rendered
        with its row: :func:`render_teacher`). A ConfigError names the place and the setting: a bad id or budget,
        one text with two ids or two teacher prompts, one id for two texts or with two budgets."""
        ids, row_of, budgets, text_of, teacher = [], {}, {}, {}, {}
        for place, prompt, extra in records:
            if teacher_template is not None:
                text = render_teacher(teacher_template, prompt, extra, f"{where}, {place}")
                if teacher.setdefault(prompt, text) != text:
                    raise ConfigError(
                        f"{where}, {place}: the prompt {prompt[:60]!r} has two teacher prompts (model.prompts.teacher_template), "
                        f"{teacher[prompt][:60]!r} and {text[:60]!r}"
                    )
            identity = prompt_id(prompt)
            if id_column is not None:
                value = extra[id_column]
                require(
                    isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip() != "",
                    f"{where}, {place}: the id in column {id_column!r} (data.id_column)",
                    "a non-empty text or an integer",
                    value,
                )
                identity = str(value)
            if budget_column is not None:
                written = value = extra[budget_column]
                with contextlib.suppress(ValueError):
                    value = float(value) if isinstance(value, str) else value  # a csv's cells are text
                low, high = FLOAT32_RANGE  # a KL the float32 KL can meet: past it the ratio KL / budget is 0 or inf
                require(
                    finite_number(value) and not isinstance(value, bool) and low <= value <= high,
                    f"{where}, {place}: the KL budget in column {budget_column!r} (model.beta_controller.init_args.budget_column)",
                    f"a finite number in [{low:g}, {high:g}] nats",
                    written,
                )
                if budgets.setdefault(identity, float(value)) != float(value):
                    raise ConfigError(
                        f"{where}, {place}: prompt id {identity!r} has two KL budgets, {budgets[identity]} and {float(value)}"
                    )
            if prompt in row_of:
                if ids[row_of[prompt]] != identity:
                    raise ConfigError(f"{where}, {place}: the prompt {prompt[:60]!r} has two ids, {ids[row_of[prompt]]!r} and {identity!r}")
            elif identity in text_of:
                raise ConfigError(f"{where}, {place}: id {identity!r} names two prompts, {text_of[identity][:40]!r} and {prompt[:40]!r}")
            else:
                row_of[prompt], text_of[identity] = len(ids), prompt
                ids.append(identity)
        return cls(ids, row_of, budgets if budget_column is not None else None, teacher if teacher_template is not None else None)

    def ids_of(self, prompts: list[str]) -> list[str]:
        """The id of each prompt (a ConfigError for one not in the table: :meth:`rows`)."""
        return [self.ids[row] for row in self.rows(prompts).tolist()]

    def teacher_prompts(self, prompts: list[str]) -> list[str]:
        """Each prompt's teacher prompt; a ConfigError for one of no prompt file's (the training and validation
        files' prompts have one: :meth:`PromptDataModule.prompt_table`)."""
        missing = [p for p in prompts if p not in self.teacher]
        require(
            not missing,
            "the teacher's prompts (model.prompts.teacher_template)",
            "of prompts of data.train_path, or of data.val_path when it has the template's columns (else set trainer.limit_val_batches: 0)",
            missing[:3],
        )
        return [self.teacher[prompt] for prompt in prompts]

    def rows(self, prompts: list[str], field: str = "the training batch") -> Tensor:
        """The row of each prompt, (len(prompts),) long; a prompt not in the table is a ConfigError naming ``field``."""
        missing = [p for p in prompts if p not in self.row_of]
        require(
            not missing,
            f"{field}: every prompt",
            "one of the training prompt file's (a per-prompt controller names only those)",
            missing[:3],
        )
        return torch.tensor([self.row_of[p] for p in prompts], dtype=torch.long)


def template_columns(template: str, field: str = "model.prompts.teacher_template") -> list[str]:
    """The prompt file's columns a teacher template names (every ``{name}`` but ``{prompt}``, the prompt's text). A
    ConfigError naming ``field``: not a format string of names (``{}``, ``{0}``, ``{a.b}``, an unmatched brace), or
    ``{prompt}`` alone (the teacher would see what the student sees: leave it null)."""
    what = 'a format string of {prompt} and the prompt file\'s columns, e.g. "{prompt}\\nThe answer is {answer}."'
    require(isinstance(template, str) and template.strip() != "", field, what, template)
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ConfigError(f"{field} must be {what}, got {template!r} ({err})") from None
    require(all(name.isidentifier() for name in names), field, f"{what} (each field a column name)", template)
    require(template.strip() != "{prompt}", field, f"{what} that adds to the prompt (null: the student's prompt)", template)
    return list(dict.fromkeys(name for name in names if name != "prompt"))


def render_teacher(template: str, prompt: str, row: dict, where: str) -> str:
    """The teacher's prompt of one row: ``template`` with ``{prompt}`` the prompt's text and each column its value
    (numbers as Python writes them); a ConfigError naming ``where``: an empty cell, or a value the field's format
    refuses."""
    values = {name: row[name] for name in template_columns(template)}
    empty = [name for name, value in values.items() if value is None or (isinstance(value, str) and not value.strip())]
    if empty:
        raise ConfigError(f"{where}: column {empty[0]!r} is empty, and model.prompts.teacher_template names it")
    try:
        return template.format_map({**values, "prompt": prompt})
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}: model.prompts.teacher_template {template!r} cannot be rendered ({err})") from None


def _records(text: str, suffix: str, where: str, column: str) -> tuple[list[tuple[str, dict]], list[str]]:
    """(place, record) pairs and the column names of a .jsonl, .json, .csv, .tsv or .txt file's text."""
    if suffix == ".txt":  # one prompt per line, whatever the column
        return [(f"line {i}", {column: line}) for i, line in enumerate(text.splitlines(), 1)], [column]
    if suffix in (".csv", ".tsv"):
        reader = csv.reader(io.StringIO(text), delimiter="\t" if suffix == ".tsv" else ",")
        header, records = next(reader), []
        for row in filter(None, reader):  # blank lines are no rows
            if len(row) != len(header):
                raise ConfigError(f"{where}, line {reader.line_num}: {len(row)} fields where the header has {len(header)}")
            records.append((f"line {reader.line_num}", dict(zip(header, row, strict=True))))
        return records, header
    if suffix == ".jsonl":
        records = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                records.append((f"line {i}", json_object(line, f"{where}, line {i}")))
    else:  # .json: a list of objects
        data = json_object(text, where, expected=list)
        records = [(f"item {i}", json_object(item, f"{where}, item {i}")) for i, item in enumerate(data, 1)]
    columns = list(dict.fromkeys(key for _, record in records for key in record))
    return records, columns


def json_object(value, where: str, expected: type = dict):
    """``value`` (JSON text, or an already parsed item) as a ``expected`` instance, or a ConfigError."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(value, expected):
        raise ConfigError(f"{where}: expected a JSON {'object' if expected is dict else 'list'}, got {type(value).__name__}")
    return value


def encode_prompts(
    tokenizer, prompts: list[str], use_chat_template: bool, max_prompt_length: int, special_tokens: str, field: str
) -> dict[str, Tensor]:
    """Render (the chat template when the tokenizer has one and ``use_chat_template``) and left-pad;
    the attention mask comes from the tokenizer (never ``ids != pad``: a chat model's pad token
    is often its end-of-turn token, inside every prompt). Each prompt is checked first (:func:`check_prompts`),
    so no batch is padded to a prompt the check refuses. Each distinct prompt is rendered and tokenised once
    (a rollout repeats each prompt ``num_generations`` times)."""
    row_of = {prompt: row for row, prompt in enumerate(dict.fromkeys(prompts))}  # distinct prompts, first seen first
    texts, templated, _ = _rendered_lengths(tokenizer, prompts, list(row_of), use_chat_template, max_prompt_length, special_tokens, field)
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)
    rows = torch.tensor([row_of[prompt] for prompt in prompts])
    return {"input_ids": enc["input_ids"][rows], "attention_mask": enc["attention_mask"][rows]}


def check_prompts(
    tokenizer,
    prompts: list[str],
    use_chat_template: bool,
    max_prompt_length: int,
    special_tokens: str,
    field: str,
    place: Optional[Callable[[str], str]] = None,
) -> int:
    """The checks of :func:`encode_prompts` on every prompt of a file, without padding any: the longest rendered
    prompt in tokens. Token counts are taken a chunk of prompts at a time, so one line far longer than the rest
    costs its own tokens, never the file's prompts x its length. ``place``: a refused prompt's place in its file
    (:func:`prompt_place`), for the message."""
    distinct = list(dict.fromkeys(prompts))
    _, _, lengths = _rendered_lengths(tokenizer, prompts, distinct, use_chat_template, max_prompt_length, special_tokens, field, place)
    return max(lengths)


def prompt_place(path: str | Path, column: str, field: str, prompt: str) -> str:
    """Where ``prompt`` first is in the prompt file ``path`` (``prompt file 'p.txt', line 16``), read again: for a message."""
    place = next((place for place, text, _ in load_prompt_records(path, column, field) if text == prompt), "not found")
    return f"prompt file {str(path)!r}, {place}"


_CHUNK = 256  # prompts tokenised at a time to count their tokens


def _rendered_lengths(tokenizer, prompts, distinct, use_chat_template, max_prompt_length, special_tokens, field, place=None):
    """(texts, templated, token counts) of the ``distinct`` prompts of ``prompts``. A ConfigError naming ``field`` (and
    the prompt's ``place`` where given): (``special_tokens: refuse``) a prompt whose text contains a special-token
    string (``<|im_end|>``, ...), which the tokenizer would turn into the special token itself, so a prompt file could
    forge chat turns; a prompt longer than ``max_prompt_length`` tokens, counted unpadded."""
    at = (lambda prompt: f", {place(prompt)}") if place is not None else (lambda prompt: "")
    if special_tokens != "allow":
        specials = sorted({t for t in (*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()) if len(t) > 1})
        for prompt in distinct:
            found = [t for t in specials if t in prompt]
            if found:
                raise ConfigError(
                    f"{field}: prompt {prompts.index(prompt)} ({prompt[:60]!r}{at(prompt)}) contains the special token string(s) "
                    f"{found}, which would be tokenised as real special tokens (a forged chat turn or end of turn); remove them, or "
                    "set model.prompts.special_tokens: allow for pre-rendered chat text"
                )
    templated = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
    if templated:
        chat = [[{"role": "user", "content": p}] for p in distinct]
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chat]
    else:
        texts = distinct
    lengths = []
    for start in range(0, len(texts), _CHUNK):  # unpadded: a list of ids per prompt
        lengths += map(len, tokenizer(texts[start : start + _CHUNK], add_special_tokens=not templated)["input_ids"])
    too_long = [row for row, length in enumerate(lengths) if length > max_prompt_length]
    if too_long:
        prompt = distinct[too_long[0]]
        raise ConfigError(
            f"{field}: prompt {prompts.index(prompt)} ({prompt[:60]!r}...{at(prompt)}) is {lengths[too_long[0]]} tokens, longer than "
            f"model.prompts.max_length={max_prompt_length} ({len(too_long)} such distinct prompts)"
        )
    return texts, templated, lengths


def token_ids(tokenizer, tokens: list[str], field: str) -> Tensor:
    """The ids of ``tokens``, each ``eos`` (the EOS token) or a single token of ``tokenizer``."""
    ids = [tokenizer.eos_token_id if token == "eos" else tokenizer.convert_tokens_to_ids(token) for token in tokens]
    for token, token_id in zip(tokens, ids, strict=True):
        require(token_id is not None and token_id != tokenizer.unk_token_id, field, "'eos' or a single token of this tokenizer", token)
    return torch.tensor(ids, dtype=torch.long)


class PromptSampler(DistributedSampler):
    """This rank's shard of a seeded per-epoch permutation, able to start mid-epoch.

    A DistributedSampler (Lightning leaves it in place and calls ``set_epoch``), even with one
    process; ``resume_at(epoch, n)`` skips the first ``n`` samples of that epoch only.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, samples_done: int) -> None:
        self._resume = (epoch, samples_done)

    def __iter__(self):
        indices = list(super().__iter__())
        if self._resume is not None and self._resume[0] == self.epoch:
            indices = indices[self._resume[1] :]
            self._resume = None
        return iter(indices)


class Lookahead:
    """An iterator over a loader's batches that can show the ones after the batch being trained, for a sampler
    that runs ahead (rlhf_lightning/async_rollout.py). It remembers the batches handed out (Lightning fetches one
    ahead) until the training step names the one it trains (``consume``); ``upcoming(n)`` reads on from the
    loader as needed."""

    def __init__(self, batches) -> None:
        self.batches = batches
        self.handed: collections.deque = collections.deque()  # handed out, not yet consumed
        self.read: collections.deque = collections.deque()  # read ahead, not yet handed out

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.read.popleft() if self.read else next(self.batches)
        self.handed.append(batch)
        return batch

    def consume(self, batch) -> bool:
        """The training step trains on ``batch`` now: forget it and the batches before it; False when it was not handed out."""
        while self.handed:
            if self.handed.popleft() == batch:
                return True
        return False

    def upcoming(self, n: int) -> list:
        """The (at most) ``n`` batches after the one consumed last, in order; fewer where the epoch ends."""
        while len(self.handed) + len(self.read) < n:
            try:
                self.read.append(next(self.batches))
            except StopIteration:
                break
        return [*self.handed, *self.read][:n]

    @staticmethod
    def of(trainer, batch, n: int) -> list:
        """The (at most) ``n`` batches after ``batch`` within the epoch's batches, read ahead from ``trainer``'s training
        loader; none where it has no look-ahead (a loader of its own) or ``batch`` is not the one it handed out."""
        lookahead = getattr(trainer.train_dataloader, "lookahead", None) if trainer is not None else None
        if lookahead is None or not lookahead.consume(batch):
            return []
        left = trainer.num_training_batches - trainer.fit_loop.epoch_loop.batch_idx - 1
        return lookahead.upcoming(min(n, left))


class PromptLoader(DataLoader):
    """A DataLoader that Lightning saves and restores with the checkpoint (it has
    ``state_dict``/``load_state_dict``), so a resumed run continues with the next unseen prompts.

    The position is the number of prompts this rank has consumed this epoch (batches the training
    loop has started, read from the trainer, since the loader runs one batch ahead because
    Lightning prefetches, times the batch size), so a run resumed with another
    ``data.batch_size`` still continues with the first prompt it has not trained on. It is saved
    with the world size: the ranks of ``PromptSampler`` deal the epoch's permutation out in turn,
    so n prompts per rank on W ranks are its first n * W, and a run resumed on W' ranks skips
    n * W / W' on each (the same prompts consumed, whatever the world size; rounded down, with a
    warning, when W' does not divide it).
    """

    def __init__(self, *args, trainer=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trainer = trainer
        self._resumed: tuple[int, int, int] | None = None  # (epoch, samples done, batches started) at a resume
        self.lookahead: Optional[Lookahead] = None  # the epoch's iterator, which reads ahead for the sampler

    def __iter__(self):
        self.lookahead = Lookahead(super().__iter__())
        return self.lookahead

    def _batches_started(self) -> int:
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def state_dict(self) -> dict[str, int]:
        epoch, started = self.trainer.current_epoch, self._batches_started()
        samples = started * self.batch_size
        if self._resumed is not None and self._resumed[0] == epoch:  # the batches before the resume had the checkpoint's size
            samples = self._resumed[1] + (started - self._resumed[2]) * self.batch_size
        return {"epoch": epoch, "samples_done": samples, "world_size": self.sampler.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed = state["samples_done"] * state.get("world_size", self.sampler.num_replicas)  # over all ranks
        samples = consumed // self.sampler.num_replicas
        if samples * self.sampler.num_replicas != consumed:
            rank_zero_warn(
                f"resuming on {self.sampler.num_replicas} processes after {consumed} prompts of epoch {state['epoch']}: each "
                f"rank skips {samples}, so {consumed - samples * self.sampler.num_replicas} prompt(s) are seen twice"
            )
        self._resumed = (state["epoch"], samples, self._batches_started())
        self.sampler.resume_at(state["epoch"], samples)


class PromptDataModule(LightningDataModule):
    """Prompts for rollouts (train) and for evaluation (validation/test).

    Args:
        train_path: prompt file for training; default: the built-in set of 360 prompts.
        val_path: prompt file for validation and test; default: the built-in 40 held-out prompts.
        prompt_column: column holding the prompt text (ignored for .txt: one prompt per line).
        batch_size: prompts per PPO iteration per process (rollout batch).
        val_batch_size: prompts per evaluation batch.
        shuffle: shuffle training prompts every epoch, with a permutation seeded by ``seed`` and the epoch.
        id_column: column of ``train_path`` holding each prompt's id, for a per-prompt beta controller
            (text or integers); default: a hash of the prompt's text (:func:`prompt_id`).
    """

    def __init__(
        self,
        train_path: Optional[str] = None,
        val_path: Optional[str] = None,
        prompt_column: str = "prompt",
        batch_size: int = 8,
        val_batch_size: int = 16,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        id_column: Optional[str] = None,
    ) -> None:
        super().__init__()
        require(
            id_column is None or (isinstance(id_column, str) and bool(id_column.strip())),
            "data.id_column",
            "a column name or null",
            id_column,
        )
        for name, value in (("batch_size", batch_size), ("val_batch_size", val_batch_size)):
            require_number(f"data.{name}", value, integer=True, at_least=1)
        require_number("data.num_workers", num_workers, integer=True, at_least=0)
        self.train_path = train_path or str(BUILTIN_TRAIN)
        self.val_path = val_path or str(BUILTIN_VALIDATION)
        self.prompt_column, self.batch_size, self.val_batch_size = prompt_column, batch_size, val_batch_size
        self.shuffle, self.seed, self.num_workers, self.id_column = shuffle, seed, num_workers, id_column
        self.train_prompts: list[str] = []
        self.val_prompts: list[str] = []

    def setup(self, stage: str) -> None:
        if stage == "fit" and not self.train_prompts:
            self.train_prompts = load_prompts(self.train_path, self.prompt_column, "data.train_path")
            needed = self.batch_size * (self.trainer.world_size if self.trainer else 1)
            if len(self.train_prompts) < needed:
                raise ConfigError(
                    f"data.train_path has {len(self.train_prompts)} prompts, fewer than one batch "
                    f"(data.batch_size={self.batch_size} per process x {needed // self.batch_size} processes)"
                )
        if not self.val_prompts:
            self.val_prompts = load_prompts(self.val_path, self.prompt_column, "data.val_path")

    def prompt_table(self, budget_column: Optional[str] = None, teacher_template: Optional[str] = None) -> PromptTable:
        """The training prompts' ids (``id_column``), KL budgets (``budget_column``, a per-prompt controller's) and
        teacher prompts (``teacher_template``, model.prompts')."""
        teacher = [(name, "model.prompts.teacher_template") for name in template_columns(teacher_template)] if teacher_template else []
        extra = {
            name: setting
            for name, setting in (
                (self.id_column, "data.id_column"),
                (budget_column, "model.beta_controller.init_args.budget_column"),
                *teacher,
            )
            if name
        }
        records = load_prompt_records(self.train_path, self.prompt_column, "data.train_path", extra)
        where = f"data.train_path: prompt file {self.train_path!r}"
        table = PromptTable.of(records, where, self.id_column, budget_column, teacher_template)
        if teacher_template:  # the validation prompts' teachers too, where their file has the columns: validation scores them
            with contextlib.suppress(ConfigError):
                records += load_prompt_records(self.val_path, self.prompt_column, "data.val_path", dict(teacher))
            where = f"data.train_path and data.val_path: prompt files {self.train_path!r}, {self.val_path!r}"
            table = dataclasses.replace(table, teacher=PromptTable.of(records, where, teacher_template=teacher_template).teacher)
        return table

    def train_dataloader(self) -> DataLoader:
        sampler = PromptSampler(
            self.train_prompts,
            num_replicas=self.trainer.world_size,
            rank=self.trainer.global_rank,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=True,
        )
        return PromptLoader(
            self.train_prompts,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            collate_fn=list,
            trainer=self.trainer,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_prompts, batch_size=self.val_batch_size, num_workers=self.num_workers, collate_fn=list)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
