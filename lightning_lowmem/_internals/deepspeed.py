"""DeepSpeed internals: the only module of the package that touches DeepSpeed's module globals and private state.

:data:`PRIVATE_SYMBOLS`, :data:`SOURCE_LINES` and :data:`SOURCE_ATTRIBUTES` are checked by ``tests/test_internals.py``.
DeepSpeed is optional and slow to import: each function imports it (NOTE: import cost).
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

#: DeepSpeed module globals used here (dotted), checked by tests/test_internals.py
PRIVATE_SYMBOLS = (
    "deepspeed.comm.comm.cdb",
    "deepspeed.utils.groups._WORLD_GROUP",
    "deepspeed.utils.groups._EXPERT_PARALLEL_GROUP",
)
#: (class path, text) a DeepSpeed class's source holds, checked by the test
SOURCE_LINES = (
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "assert len(set(p.ds_id for p in params_in_bucket))"),
)
#: (class path, method, attribute) DeepSpeed assigns in that method, checked in the method's source by the test
SOURCE_ATTRIBUTES = (
    ("deepspeed.ops.adam.DeepSpeedCPUAdam", "__init__", "self.ds_opt_adam"),
    ("deepspeed.ops.adam.DeepSpeedCPUAdam", "__init__", "self.opt_id"),
    ("deepspeed.runtime.zero.partition_parameters.InsertPostInitMethodToModuleSubClasses",
     "_enable_mem_efficient_linear", "InsertPostInitMethodToModuleSubClasses.linear_bk"),
)


def drop_stale_process_groups() -> None:
    """Forget DeepSpeed's cached communication backend and process groups when torch.distributed is down.
    NOTE: DeepSpeed keeps ``deepspeed.comm.comm.cdb`` and ``deepspeed.utils.groups._*_GROUP`` after
    ``destroy_process_group``; a second fit in the process would use the dead groups. It has no public reset.
    """
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    if ds_comm.cdb is not None and not torch.distributed.is_initialized():
        ds_comm.cdb = None
        for name, value in list(vars(groups).items()):
            if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS")):
                setattr(groups, name, {} if isinstance(value, dict) else None)


def cpu_adam_update(adam: Any, step: int, group: dict[str, Any], *tensors: Any) -> None:
    """One call of ``DeepSpeedCPUAdam``'s C++ ``adam_update`` for param group ``group`` at ``step``.

    NOTE: ``load_state_dict`` does not restore the C++ step count and bias corrections; replaying the steps with empty
    ``tensors`` does, and only ``ds_opt_adam`` and ``opt_id`` reach that state.
    """
    beta1, beta2 = group["betas"]
    adam.ds_opt_adam.adam_update(
        adam.opt_id, step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], group["bias_correction"],
        *tensors,
    )


def undo_zero3_linear() -> None:
    """Put back the ``torch.nn.functional.linear`` that ZeRO stage 3's ``zero.Init`` replaced process-wide.
    NOTE: DeepSpeed never puts it back (the original stays in a class attribute of ``zero.Init``): every linear layer
    run after ``fit`` would round differently. The package's only write to a torch module attribute.
    """
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None and torch.nn.functional.linear is zero3_linear_wrap:
        torch.nn.functional.linear = original


def reduced_twice(err: AssertionError) -> str | None:
    """What DeepSpeed asserted when it refused a gradient reduced twice in one backward (ZeRO-1/2's message, or the
    source line of ZeRO-3's bare ``assert``: :data:`SOURCE_LINES`), or None for another assertion."""
    if "already been reduced" in str(err):
        return " ".join(str(err).split())
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return frame.line if "deepspeed" in frame.filename and "ds_id" in (frame.line or "") else None
