"""The checkpoint engine of the ``lowmem_zero*`` presets: DeepSpeed's torch engine with hashed writes and weights-only
reads checked against the digest manifest (unless :meth:`~CheckedCheckpointEngine.reading` opts in).

NOTE: imports DeepSpeed (slow): ``ZeroStrategy`` imports this module when it builds an engine.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from typing_extensions import override

from lightning_lowmem.core import trusted_load as _trusted_load
from lightning_lowmem.strategies.zero import checkpoint as zckpt


class CheckedCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's ``TorchCheckpointEngine`` with hashed writes and checked, weights-only reads (module docstring)."""

    def __init__(self, zipfile_serialization: bool = True) -> None:
        super().__init__(None)
        self.zipfile_serialization = zipfile_serialization  # NOTE: the replaced engine's (DeepSpeed's config)
        self._into: Path | None = None
        self._check: _trusted_load.ManifestCheck | None = None
        self._trusted = False
        self._opt_in = _trusted_load.TRAINER_OPT_IN

    @contextlib.contextmanager
    def writing_into(self, tmp: str | os.PathLike) -> Iterator[None]:
        """While inside, the files DeepSpeed writes (all under ``tmp``) are hashed as written."""
        self._into = Path(tmp).absolute()
        try:
            yield
        finally:
            self._into = None

    @contextlib.contextmanager
    def reading(self, directory: str | os.PathLike, *, trusted: bool, opt_in: str) -> Iterator[None]:
        """While inside, files of ``directory`` are checked against its manifest; ``trusted`` reads them fully."""
        self._check, self._trusted, self._opt_in = _trusted_load.ManifestCheck(directory), trusted, opt_in
        try:
            yield
        finally:
            self._check, self._trusted, self._opt_in = None, False, _trusted_load.TRAINER_OPT_IN

    @override
    def save(self, state_dict: Any, path: str) -> None:
        if self._into is None:
            return super().save(state_dict, path)
        return zckpt.write_hashed(state_dict, path, self._into, self.zipfile_serialization)

    @override
    def load(self, path: str, map_location: Any = None) -> Any:
        return _trusted_load.checked_load(path, self._check, trusted=self._trusted, opt_in=self._opt_in,
                                          map_location=map_location)


def install(engine: Any) -> CheckedCheckpointEngine:
    """Give DeepSpeed's ``engine`` a :class:`CheckedCheckpointEngine` in place of the torch engine it built
    (ValueError when the config chose another engine or universal-checkpoint loading)."""
    built = engine.checkpoint_engine  # NOTE: None on a ZeRO-3 engine without optimizer (DeepSpeed's loader makes one)
    if (built is not None and not isinstance(built, TorchCheckpointEngine)) or engine.load_universal_checkpoint():
        what = "universal-checkpoint loading" if engine.load_universal_checkpoint() else f"`{type(built).__name__}`"
        raise ValueError(
            f"The DeepSpeed config selects {what} (`config['checkpoint']`, `config['datastates_ckpt']`). The "
            "`lowmem_zero*` presets write their checkpoints through DeepSpeed's torch checkpoint engine (atomic, "
            "hashed) and read them weights-only, which these replace (DeepSpeed's universal loader unpickles its "
            "files fully). Remove the setting, or use Lightning's `DeepSpeedStrategy`."
        )
    engine.checkpoint_engine = CheckedCheckpointEngine(built.zipfile_serialization if built is not None else True)
    return engine.checkpoint_engine
