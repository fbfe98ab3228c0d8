import pytest
import torch

from lightning_lowmem.demo.data import IGNORE_INDEX, StdlibTextDataModule, stdlib_files


def test_reads_stdlib_sources():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("test" in f.parts for f in files)


def test_packed_blocks_are_full_and_deterministic():
    dm = StdlibTextDataModule(seq_len=32, batch_size=4, max_bytes=10_000)
    dm.setup("fit")
    a = next(iter(dm.train_dataloader()))
    b = next(iter(dm.train_dataloader()))
    assert torch.equal(a["input_ids"], b["input_ids"])  # seeded shuffle
    assert a["attention_mask"].all() and (a["labels"] == a["input_ids"]).all()


def test_unpacked_sequences_have_different_lengths():
    dm = StdlibTextDataModule(seq_len=4096, batch_size=8, max_bytes=200_000, pack=False)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    lengths = batch["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1
    assert ((batch["labels"] == IGNORE_INDEX) == (batch["attention_mask"] == 0)).all()


def test_bad_arguments_reported_together():
    with pytest.raises(ValueError, match=r"seq_len=1.*batch_size=0"):
        StdlibTextDataModule(seq_len=1, batch_size=0)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        stdlib_files("/no/such/dir")
