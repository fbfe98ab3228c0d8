"""A byte-level tokenizer shipped with the project: no vocabulary file, nothing to download."""

from __future__ import annotations

import torch


class ByteTokenizer:
    """Maps UTF-8 bytes to ids 0..255, plus ``eos_token_id=256`` and ``pad_token_id=257``.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.decode(tok.encode("def f(): pass"))
        'def f(): pass'
    """

    eos_token_id = 256
    pad_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids + [self.eos_token_id] if add_eos else ids

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size
