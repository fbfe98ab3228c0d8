"""Private Lightning APIs: the only module of the package that touches them, each with a NOTE on why.

:data:`PRIVATE_SYMBOLS`, :data:`INSTANCE_ATTRIBUTES`, :data:`OVERRIDDEN` and :data:`INHERITED` list every one;
``tests/test_internals.py`` checks they exist in the installed Lightning, ``tests/test_package.py`` that no other
module uses an unlisted one.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.plugins.precision import Precision

#: every private module-level Lightning name used here (dotted), checked by tests/test_internals.py
PRIVATE_SYMBOLS = (
    "lightning.fabric.plugins.precision.utils._convert_fp_tensor",
    "lightning.fabric.plugins.precision.utils._DtypeContextManager",
    "lightning.fabric.utilities.cloud_io._is_local_file_protocol",
    "lightning.fabric.utilities.types._PATH",
    "lightning.pytorch.plugins.io.wrapper._WrappingCheckpointIO",
    "lightning.pytorch.plugins.precision.Precision._after_closure",
    "lightning.pytorch.cli.LightningCLI._get",
    "lightning.pytorch.cli.LightningCLI._add_configure_optimizers_method_to_model",
    "lightning.pytorch.strategies.Strategy._setup_model",
)
#: private attributes of Lightning objects (class path -> names), checked on an instance by the test
INSTANCE_ATTRIBUTES = {
    "lightning.pytorch.LightningModule": ("_trainer", "_current_fx_name"),
    "lightning.pytorch.Trainer": ("_accelerator_connector",),
    "lightning.pytorch.loops.fit_loop._FitLoop": ("_data_source",),
    "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector": ("strategy", "precision_plugin"),
    "lightning.pytorch.strategies.FSDPStrategy": ("_activation_checkpointing_kwargs",),
}
#: private hooks of Lightning classes that the package's subclasses override (class path -> method names)
OVERRIDDEN = {
    # NOTE: `MasterHalfPrecision` runs `on_before_optimizer_step` and the clipping on the fp32 masters: Lightning calls
    # them from this hook, between the closure and the step
    "lightning.pytorch.plugins.precision.Precision": ("_after_closure",),
    # NOTE: `LowMemCLI` names a damaged `--ckpt_path` before LightningCLI torch.loads it for the hyperparameters
    "lightning.pytorch.cli.LightningCLI": ("_parse_ckpt_path",),
    # NOTE: `ZeroStrategy` runs DeepSpeed on the CPU accelerator (gloo), swaps in DeepSpeed's CPU Adam and refuses
    # configurations DeepSpeed would get wrong: each is a step of DeepSpeedStrategy with no public hook
    "lightning.pytorch.strategies.DeepSpeedStrategy": ("_format_config", "_init_deepspeed_distributed",
                                                       "_init_optimizers", "_initialize_deepspeed_inference",
                                                       "_setup_model_and_optimizer"),
}
#: private attributes of Lightning base classes that the package's subclasses read or set through ``self``
INHERITED = {
    # NOTE: `OffloadStrategy` overrides the `root_device`, `precision_plugin` and `checkpoint_io` properties, whose
    # storage these are (it builds its own precision plugin and checkpoint IO when none is given)
    "lightning.pytorch.strategies.Strategy": ("_root_device", "_precision_plugin", "_checkpoint_io"),
}

#: ``Union[str, Path]``: the path type of Lightning's checkpoint signatures (an override keeps its annotation)
PATH = _PATH
#: a checkpoint IO that wraps another (``AsyncCheckpointIO``): ``OffloadStrategy`` fills in its inner IO
WrappingCheckpointIO = _WrappingCheckpointIO
#: ``with DtypeContextManager(dtype):`` sets torch's default dtype, as Lightning's ``HalfPrecision`` does
DtypeContextManager = _DtypeContextManager
#: ``convert_fp_tensor(tensor, dst_type)``: a floating-point tensor cast (others unchanged), as ``HalfPrecision`` does
convert_fp_tensor = _convert_fp_tensor
#: ``is_local_file_protocol(path)``: not ``s3://``... (Lightning's own test before it writes)
is_local_file_protocol = _is_local_file_protocol
#: ``Precision._after_closure(plugin, model, optimizer)``: ``on_before_optimizer_step``, then the gradient clipping
precision_after_closure = Precision._after_closure


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or None (NOTE: the public ``module.trainer`` raises without one)."""
    return getattr(module, "_trainer", None)


def current_hook(module: Any) -> str | None:
    """The hook Lightning is running ``module``'s code from (None outside every hook: ``self.log`` would refuse)."""
    return getattr(module, "_current_fx_name", None)


def fit_data_source(trainer: Any) -> Any:
    """The fit loop's data source (``.instance``, ``.dataloader()``): the only place the loader's batch size can be
    read before the loop starts (the planner of ``lowmem_auto``, ZeRO's micro-batch size)."""
    return trainer.fit_loop._data_source


def replace_strategy(trainer: Any, strategy: Any) -> None:
    """Make ``strategy`` (with its precision plugin) the Trainer's from now on (``lowmem_auto``'s hand-over at fit
    start; the accelerator connector has no public setter)."""
    connector = trainer._accelerator_connector
    connector.strategy = strategy
    connector.precision_plugin = strategy.precision_plugin


def keep_strategy(trainer: Any, strategy: Any) -> None:
    """Make ``strategy`` the Trainer's again, as chosen by an earlier fit (its precision plugin already is)."""
    trainer._accelerator_connector.strategy = strategy


def setup_model(strategy: Any, model: Any) -> Any:
    """``Strategy._setup_model(model)``: the step of ``Strategy.setup`` that ``OffloadStrategy.setup`` calls to keep
    Lightning's order (the strategy's wrapping of the module; none for a single device)."""
    return strategy._setup_model(model)


def cli_get(cli: Any, config: Any, key: str, default: Any = None) -> Any:
    """``LightningCLI._get``: ``config[key]`` of the subcommand being run (``default`` where it has none)."""
    return cli._get(config, key, default=default)


def cli_add_configure_optimizers(cli: Any, subcommand: str | None) -> None:
    """``LightningCLI._add_configure_optimizers_method_to_model``: the YAML's ``optimizer:``/``lr_scheduler:`` become
    the model's ``configure_optimizers`` (what ``instantiate_classes`` does after building the classes)."""
    cli._add_configure_optimizers_method_to_model(subcommand)


def fsdp_checkpointing_policy(strategy: Any) -> Any:
    """``FSDPStrategy``'s own activation-checkpointing setting (empty when it has none; private after the
    constructor): ``ActivationCheckpointing`` refuses to checkpoint the same blocks twice."""
    return getattr(strategy, "_activation_checkpointing_kwargs", None)
