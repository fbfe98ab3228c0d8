"""The lean optimizers' parameter-group rules and builders. Every builder returns ``(optimizer, sources)``:
``sources[j]`` is the configured param group new group ``j`` came from (for the LR schedulers).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.core.optional import loaded_class, require

# kind -> (import name, extra of lightning-lowmem)
PACKAGES: dict[str, tuple[str, str]] = {
    "galore": ("galore_torch", "galore"),
    "apollo": ("apollo_torch", "apollo"),
    "apollo_mini": ("apollo_torch", "apollo"),
    "adam_mini": ("adam_mini", "adam-mini"),
    "adamw4bit": ("torchao.optim", "torchao"),
    "adamw8bit": ("torchao.optim", "torchao"),
}
# kind -> (rank, scale) defaults: GaLore's README (rank 128, scale 0.25), APOLLO's (rank 256, scale 1, channel-wise
# scaling) and APOLLO-Mini's (rank 1, scale 128, tensor-wise scaling)
PROJECTION_DEFAULTS: dict[str, tuple[int, float]] = {"galore": (128, 0.25), "apollo": (256, 1.0),
                                                     "apollo_mini": (1, 128.0)}
# per-group lists of torch's LR schedulers (public attributes)
_PER_GROUP = ("base_lrs", "lr_lambdas", "min_lrs", "max_lrs", "base_momentums", "max_momentums")
# keys of a torch optimizer's groups that the packages' optimizers do not read (dropped)
_TORCH_ONLY = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")


def import_package(kind: str, feature: str) -> Any:
    """The package module of ``kind``; ``ModuleNotFoundError`` naming the extra when it is not installed."""
    name, _ = PACKAGES[kind]
    require(name.split(".")[0], feature)  # NOTE: the top-level name is the one the extras table knows
    return importlib.import_module(name)


def projectable_weights(module: torch.nn.Module) -> tuple[dict[int, str], set[int]]:
    """The 2-D weights GaLore/APOLLO may project (every ``nn.Linear``/``Conv1D`` weight), by ``id``, with their names;
    and the ids ruled out (a weight tied to an ``nn.Embedding``, the output head), as the packages' scripts choose."""
    conv1d = loaded_class("transformers.pytorch_utils", "Conv1D")
    linear_types: tuple[type, ...] = (torch.nn.Linear, conv1d) if conv1d is not None else (torch.nn.Linear,)
    excluded = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    for m in module.modules():
        head = getattr(m, "get_output_embeddings", None)
        out = head() if callable(head) else None
        if isinstance(out, torch.nn.Module) and isinstance(getattr(out, "weight", None), Tensor):
            excluded.add(id(out.weight))
    found: dict[int, str] = {}
    for name, m in module.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(m, linear_types) and isinstance(w, Tensor) and w.dim() == 2 and id(w) not in excluded:
            found.setdefault(id(w), f"{name}.weight" if name else "weight")
    return found, excluded


def projection_plan(optimizer: Optimizer, module_param: Callable[[Tensor], Tensor], module: torch.nn.Module,
                    rank: int, call: str) -> set[int]:
    """Ids of ``optimizer``'s params to project at ``rank`` (those whose smaller side is above it); ``ValueError`` when
    there are none. ``module_param(p)``: the module parameter ``p`` stands for (a lowmem_offload master's)."""
    candidates, _ = projectable_weights(module)
    chosen, too_small = set(), []
    for group in optimizer.param_groups:
        for p in group["params"]:
            m = module_param(p)
            if id(m) in candidates and p.requires_grad:
                if min(p.shape) > rank:
                    chosen.add(id(p))
                else:
                    too_small.append(f"{candidates[id(m)]} {tuple(p.shape)}")
    if not candidates:
        raise ValueError(
            f"{call}: `{type(module).__name__}` has no 2-D weight to project (no `nn.Linear`/`Conv1D` weight other "
            "than an embedding or the output head); GaLore/APOLLO save memory only on those. Use "
            "kind='adam_mini', 'adamw8bit' or 'adamw4bit' for this model, or remove the callback."
        )
    if not chosen:
        raise ValueError(
            f"{call}: no 2-D weight is larger than rank={rank} on its smaller side ({', '.join(too_small[:4])}"
            f"{', ...' if len(too_small) > 4 else ''}), so a projection would save nothing. Pass a smaller `rank`."
        )
    return chosen


def _plain(group: dict[str, Any], params: list[Tensor]) -> dict[str, Any]:
    return {**{k: v for k, v in group.items() if k not in _TORCH_ONLY}, "params": params}


def _defaults(optimizer: Optimizer) -> dict[str, Any]:
    return {k: optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay") if k in optimizer.defaults}


def build_projected(kind: str, optimizer: Optimizer, projected: set[int], options: dict[str, Any],
                    feature: str) -> tuple[Optimizer, list[int]]:
    """GaLore's or APOLLO's AdamW over ``optimizer``'s groups: each group's other params first, its projected ones
    in a group after all of them, with ``rank``/``update_proj_gap``/``scale``/``proj_type`` (and APOLLO's
    ``proj``/``scale_type``), as the packages' READMEs lay the groups out."""
    package = import_package(kind, feature)
    cls = package.GaLoreAdamW if kind == "galore" else package.APOLLOAdamW
    low_rank = dict(options)  # rank, update_proj_gap, scale, proj_type
    if kind != "galore":
        low_rank.update(proj="random", scale_type="tensor" if kind == "apollo_mini" else "channel")
    groups, sources, split = [], [], []
    for i, group in enumerate(optimizer.param_groups):
        groups.append(_plain(group, [p for p in group["params"] if id(p) not in projected]))
        sources.append(i)
        mine = [p for p in group["params"] if id(p) in projected]
        if mine:
            split.append((i, {**_plain(group, mine), **low_rank}))
    groups += [g for _, g in split]
    sources += [i for i, _ in split]
    return cls(groups, **_defaults(optimizer), no_deprecation_warning=True), sources


def build_adam_mini(optimizer: Optimizer, names: Callable[[Tensor], str], shape: dict[str, int | None],
                    feature: str) -> tuple[Optimizer, list[int]]:
    """Adam-mini over ``optimizer``'s params, named as in the module (Adam-mini partitions by name: embeddings and
    output per token, queries/keys per head, values/MLP per neuron, the rest per tensor). Each of its groups takes
    ``lr``/``betas``/``eps`` from its source group; ``weight_decay`` too, except where Adam-mini itself sets none
    (norms and biases, by name)."""
    package = import_package("adam_mini", feature)
    named, source_of = [], []
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.requires_grad:
                named.append((names(p), p))
                source_of.append(i)
    g0 = optimizer.param_groups[0]
    # NOTE: built with weight_decay=1.0 so that the groups Adam-mini exempts by name read 0.0 afterwards
    new = package.Adam_mini(named_parameters=named, lr=g0["lr"], betas=g0["betas"], eps=g0["eps"], weight_decay=1.0,
                            verbose=False, **{k: v for k, v in shape.items() if v is not None})
    for group, i in zip(new.param_groups, source_of):
        src = optimizer.param_groups[i]
        group.update(lr=src["lr"], beta1=src["betas"][0], beta2=src["betas"][1], eps=src["eps"],
                     weight_decay=src.get("weight_decay", 0.0) if group["weight_decay"] else 0.0)
        if "initial_lr" in src:
            group["initial_lr"] = src["initial_lr"]
    return new, source_of


def build_torchao(kind: str, optimizer: Optimizer, block_size: int | None, feature: str) -> tuple[Optimizer, list[int]]:
    """torchao's ``AdamW8bit``/``AdamW4bit`` over the same groups (one for one)."""
    package = import_package(kind, feature)
    cls = package.AdamW4bit if kind == "adamw4bit" else package.AdamW8bit
    groups = [{**_plain(g, list(g["params"])), "amsgrad": False} for g in optimizer.param_groups]
    extra = {"block_size": block_size} if block_size is not None else {}
    return cls(groups, **_defaults(optimizer), **extra), list(range(len(groups)))


def eager_on_fake_tensors(optimizer: Optimizer) -> list[Any]:
    """Step hooks that run torchao's compiled step eagerly when its params are fake tensors (the dry run).
    NOTE: torchao's ``torch.compile(..., fullgraph=True)`` finds no frame under the fake-tensor mode."""

    def stance(name: str) -> Callable[..., None]:
        def hook(opt: Optimizer, args: Any, kwargs: Any) -> None:
            if any(isinstance(p, torch_internals.FakeTensor) for g in opt.param_groups for p in g["params"]):
                torch.compiler.set_stance(name)
        return hook

    return [optimizer.register_step_pre_hook(stance("force_eager")),
            optimizer.register_step_post_hook(stance("default"))]


def expand_scheduler(scheduler: Any, sources: Sequence[int]) -> None:
    """Give ``scheduler`` (and every scheduler it chains) one entry per new group in its per-group lists (``base_lrs``,
    ``lr_lambdas``, ...): that of the group's source. Lists of another length are left alone."""
    for child in torch_internals.chained_schedulers(scheduler):
        expand_scheduler(child, sources)
    n_old = max(sources) + 1
    for attr in _PER_GROUP:
        values = getattr(scheduler, attr, None)
        if isinstance(values, list) and len(values) == n_old and len(sources) != n_old:
            setattr(scheduler, attr, [values[i] for i in sources])


def compact_projections(optimizer: Optimizer, args: Any = None, kwargs: Any = None) -> None:
    """``step`` post-hook: a projection matrix that is a slice of a larger SVD factor gets its own storage.
    NOTE: GaLore's ``Vh[:rank, :]`` / ``U[:, :rank]`` view keeps the whole factor alive (a square weight's size)."""
    for state in optimizer.state.values():
        proj = state.get("projector")
        matrix = getattr(proj, "ortho_matrix", None)
        parts = matrix if isinstance(matrix, list) else [matrix]
        if not any(isinstance(t, Tensor) and _oversized(t) for t in parts):
            continue
        compacted = [t.clone() if isinstance(t, Tensor) and _oversized(t) else t for t in parts]
        proj.ortho_matrix = compacted if isinstance(matrix, list) else compacted[0]


def _oversized(t: Tensor) -> bool:
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


_PROJECTOR_KEY = "lean_projector"
_STR = "utf8"
_PROJECTORS = (("galore_torch.galore_projector", "GaLoreProjector"), ("apollo_torch.svd_projector", "GaLoreProjector"),
               ("apollo_torch.random_projector", "GradientProjector"))


def projectors_to_plain(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` post-hook: each projector object (a class of the package) becomes a dict of tensors and
    numbers, so a checkpoint loads with ``torch.load(weights_only=True)``."""
    # NOTE: the state dict's per-parameter dicts are the optimizer's own: replaced by copies, never edited
    for key, state in list(state_dict["state"].items()):
        proj = state.get("projector")
        if proj is None or isinstance(proj, dict):
            continue
        # NOTE: by type against the classes already imported (an object of one exists only then), never by name
        index = next((i for i, (m, n) in enumerate(_PROJECTORS) if isinstance(proj, loaded_class(m, n) or ())), None)
        if index is None:
            continue
        fields = dict(vars(proj))
        if isinstance(fields.get("ortho_matrix"), list):  # proj_type="full" keeps two matrices
            fields["ortho_matrix"] = tuple(fields["ortho_matrix"])
        # NOTE: `Optimizer.load_state_dict` rebuilds iterables with `type(v)(generator)`: strings travel as UTF-8 codes
        fields = {k: {_STR: tuple(v.encode())} if isinstance(v, str) else v for k, v in fields.items()}
        state_dict["state"][key] = {**state, "projector": {_PROJECTOR_KEY: index, **fields}}
    return state_dict


def projectors_from_plain(optimizer: Optimizer) -> None:
    """``load_state_dict`` post-hook: rebuild the projector objects :func:`projectors_to_plain` flattened."""
    for state in optimizer.state.values():
        plain = state.get("projector")
        if not isinstance(plain, dict) or _PROJECTOR_KEY not in plain:
            continue
        fields = {k: bytes(v[_STR]).decode() if isinstance(v, dict) and _STR in v else v
                  for k, v in plain.items() if k != _PROJECTOR_KEY}
        if isinstance(fields.get("ortho_matrix"), tuple):
            fields["ortho_matrix"] = list(fields["ortho_matrix"])
        module, name = _PROJECTORS[plain[_PROJECTOR_KEY]]
        require(module.split(".")[0], "loading a GaLore/APOLLO optimizer state")
        cls = getattr(importlib.import_module(module), name)
        proj = cls.__new__(cls)
        proj.__dict__.update(fields)
        state["projector"] = proj
