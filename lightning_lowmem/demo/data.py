"""Training text that exists on every machine: the Python standard library's own ``.py`` files."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_lowmem.demo.tokenizer import ByteTokenizer

IGNORE_INDEX = -100


def stdlib_files(root: str | None = None) -> list[Path]:
    """The standard library's top-level and package ``.py`` files, in a stable order (tests excluded)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"Passed `root={str(base)!r}`, which is not a directory of Python files.")
    files = [p for p in sorted(base.rglob("*.py")) if not {"test", "tests", "site-packages"} & set(p.parts)]
    if not files:
        raise FileNotFoundError(f"No `.py` files under {str(base)!r}.")
    return files


class _Blocks(Dataset):
    def __init__(self, items: list[tuple[list[int], int]], seq_len: int, pad_id: int) -> None:
        self.items, self.seq_len, self.pad_id = items, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, n = self.items[i]
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        input_ids[:n] = torch.tensor(ids[:n], dtype=torch.long)
        attention_mask = torch.zeros(self.seq_len, dtype=torch.long)
        attention_mask[:n] = 1
        labels = input_ids.clone()
        labels[n:] = IGNORE_INDEX
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class StdlibTextDataModule(L.LightningDataModule):
    """Byte-tokenised Python source from the standard library, for causal-LM training.

    Args:
        seq_len: tokens per sequence.
        batch_size: micro-batch size (``AccumulationScheduler`` and ``BatchSizeFinder`` set this attribute).
        max_bytes: how much text to read, from the start of the sorted file list.
        pack: ``True`` cuts the concatenated text into full blocks; ``False`` takes one block per file,
            padded, so sequences hold different numbers of tokens (labels of padding are -100).
        val_fraction: share of the blocks held out for validation (taken from the end).
        root: directory to read instead of the standard library.

    Example:
        >>> dm = StdlibTextDataModule(seq_len=64, batch_size=2, max_bytes=20_000)
        >>> dm.setup("fit")
        >>> next(iter(dm.train_dataloader()))["input_ids"].shape
        torch.Size([2, 64])
    """

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 8,
        max_bytes: int = 2_000_000,
        pack: bool = True,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        root: str | None = None,
    ) -> None:
        super().__init__()
        problems = []
        if seq_len < 2:
            problems.append(f"`seq_len={seq_len}` must be at least 2")
        if batch_size < 1:
            problems.append(f"`batch_size={batch_size}` must be at least 1")
        if max_bytes < seq_len:
            problems.append(f"`max_bytes={max_bytes}` must be at least `seq_len`")
        if not 0.0 <= val_fraction < 1.0:
            problems.append(f"`val_fraction={val_fraction}` must be in [0, 1)")
        if problems:
            raise ValueError("StdlibTextDataModule: " + "; ".join(problems) + ".")
        self.seq_len, self.batch_size, self.max_bytes = seq_len, batch_size, max_bytes
        self.pack, self.val_fraction, self.num_workers, self.root = pack, val_fraction, num_workers, root
        self.tokenizer = ByteTokenizer()
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def _items(self) -> list[tuple[list[int], int]]:
        tok, items, budget = self.tokenizer, [], self.max_bytes
        if self.pack:
            stream: list[int] = []
            for path in stdlib_files(self.root):
                stream += tok.encode(path.read_text(encoding="utf-8", errors="replace"), add_eos=True)
                if len(stream) >= budget:
                    break
            stream = stream[:budget]
            n = self.seq_len
            items = [(stream[i : i + n], n) for i in range(0, len(stream) - n + 1, n)]
        else:
            for path in stdlib_files(self.root):
                ids = tok.encode(path.read_text(encoding="utf-8", errors="replace"), add_eos=True)[: self.seq_len]
                items.append((ids, len(ids)))
                budget -= len(ids)
                if budget <= 0:
                    break
        if len(items) < 2:
            raise ValueError(f"`max_bytes={self.max_bytes}` gives fewer than 2 sequences of `seq_len={self.seq_len}`.")
        return items

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        items = self._items()
        n_val = max(1, int(len(items) * self.val_fraction)) if self.val_fraction > 0 else 0
        pad = self.tokenizer.pad_token_id
        self.train_set = _Blocks(items[: len(items) - n_val], self.seq_len, pad)
        self.val_set = _Blocks(items[len(items) - n_val :] or items[-1:], self.seq_len, pad)

    @override
    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator,
            num_workers=self.num_workers, drop_last=False,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
