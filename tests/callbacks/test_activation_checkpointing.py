"""ActivationCheckpointing without a Trainer: parity with the plain model, wrapping, discovery, bad input."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_lowmem._internals import torch as torch_internals
from lightning_lowmem.callbacks.activation_checkpointing import segments as _segments
from lightning_lowmem.callbacks.activation_checkpointing.callback import (
    ActivationCheckpointing,
    choose_for_budget,
    parse_bytes,
)
from lightning_lowmem.callbacks.activation_checkpointing.hooks import (
    checkpoint_info,
    checkpointed_modules,
    remove_checkpointing,
)
from lightning_lowmem.core import blocks as _blocks
from lightning_lowmem.measure import tracker as measure
from tests.helpers.models import random_batch, tiny_gpt2, tiny_llama

STEPS = 3


class EncoderModel(nn.Module):
    """``nn.TransformerEncoder`` with an embedding and a head, dropout on."""

    def __init__(self, layers: int = 4, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.encoder(self.embed(input_ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class BetweenBlocks(nn.Module):
    """Blocks with dropout, and code of the owner between them (scaling, a shared mask, its own dropout)."""

    def __init__(self, layers: int = 5, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * width, width))
            for _ in range(layers)
        )
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.sigmoid(x.sum(-1, keepdim=True))
        for i, block in enumerate(self.blocks):
            x = block(x) * mask + x
            if i % 2:
                x = self.drop(x.tanh())
        return x.pow(2).mean()


def _hf_loss(model: nn.Module, step: int) -> torch.Tensor:
    b = random_batch(batch_size=2, seq_len=16, seed=step)
    return model(input_ids=b["input_ids"], labels=b["labels"]).loss


def _encoder_loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    return model(ids, ids.roll(1, 1))


def _between_loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(step)))


def _train(model: nn.Module, loss_fn, steps: int = STEPS) -> tuple[list[dict], dict]:
    torch.manual_seed(1234)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for step in range(steps):
        loss_fn(model, step).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _gpt2() -> nn.Module:
    model = tiny_gpt2(dropout=0.1)
    model.config.use_cache = False
    return model


def _llama() -> nn.Module:
    model = tiny_llama(attention_dropout=0.1)
    model.config.use_cache = False
    return model


MODELS = {"gpt2": (_gpt2, _hf_loss), "llama": (_llama, _hf_loss), "encoder": (EncoderModel, _encoder_loss)}
POLICIES = {
    "all": {"policy": "all"},
    "every_n": {"policy": "every_n", "n": 2},
    "sqrt": {"policy": "sqrt"},
    "selective": {"policy": "selective"},
}


def _apply(model: nn.Module, **kwargs) -> ActivationCheckpointing:
    cb = ActivationCheckpointing(**kwargs)
    cb._apply(model)
    return cb


def _count_block_forwards(model: nn.Module, loss_fn=None, run=None) -> list[int]:
    """How often each repeated block's own forward runs in one forward + backward (or in ``run()``)."""
    blocks = [m for _, m in _blocks.find_repeated_blocks(model)]
    counts = [0] * len(blocks)
    index = {id(b): i for i, b in enumerate(blocks)}
    cls = type(blocks[0])
    original = cls.forward

    def counting(self, *args, **kwargs):
        counts[index[id(self)]] += 1
        return original(self, *args, **kwargs)

    cls.forward = counting
    try:
        if run is None:
            loss_fn(model, 0).backward()
        else:
            run()
    finally:
        cls.forward = original
    return counts


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_bit_identical_to_plain_model(model_name, policy):
    build, loss_fn = MODELS[model_name]
    torch.manual_seed(0)
    reference = build()
    model = copy.deepcopy(reference)
    cb = _apply(model, **POLICIES[policy])
    assert cb.wrapped, "nothing was checkpointed"
    # checkpointed blocks really run twice (forward + recompute), the others once
    counts = _count_block_forwards(copy.deepcopy(model), loss_fn)
    wrapped = {name for name in cb.wrapped}
    names = [n for n, _ in _blocks.find_repeated_blocks(model)]
    assert counts == [2 if n in wrapped else 1 for n in names]

    ref_grads, ref_weights = _train(reference, loss_fn)
    grads, weights = _train(model, loss_fn)
    for step, (g_ref, g) in enumerate(zip(ref_grads, grads)):
        assert g_ref.keys() == g.keys()
        for name in g_ref:
            assert torch.equal(g_ref[name], g[name]), f"step {step}: gradient of {name} differs"
    for name in ref_weights:
        assert torch.equal(ref_weights[name], weights[name]), f"weight {name} differs"


def test_explicit_class_names_bit_identical():
    torch.manual_seed(0)
    reference = EncoderModel()
    model = copy.deepcopy(reference)
    cb = _apply(model, policy=["TransformerEncoderLayer"])
    assert cb.wrapped == [f"encoder.layers.{i}" for i in range(4)]
    ref_grads, ref_weights = _train(reference, _encoder_loss)
    grads, weights = _train(model, _encoder_loss)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(ref_grads, grads) for k in a)
    assert all(torch.equal(ref_weights[k], weights[k]) for k in ref_weights)


@pytest.mark.parametrize("policy", ["sqrt", "all"])
def test_code_between_blocks_and_dropout_outside(policy):
    torch.manual_seed(0)
    reference = BetweenBlocks()
    model = copy.deepcopy(reference)
    cb = _apply(model, policy=policy)
    assert len(cb.wrapped) == 5
    ref_grads, ref_weights = _train(reference, _between_loss)
    grads, weights = _train(model, _between_loss)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(ref_grads, grads) for k in a)
    assert all(torch.equal(ref_weights[k], weights[k]) for k in ref_weights)


def test_sqrt_segments_cover_blocks_in_order():
    model = _gpt2()
    model.transformer.h.extend(copy.deepcopy(model.transformer.h))  # 8 blocks -> segments of round(sqrt 8) = 3
    model.config.n_layer = 8
    _apply(model, policy="sqrt")
    infos = [checkpoint_info(b) for b in model.transformer.h]
    assert [(i.segment, i.position, i.is_boundary) for i in infos] == [
        (0, 0, True), (0, 1, False), (0, 2, False), (1, 0, True), (1, 1, False), (1, 2, False), (2, 0, True), (2, 1, False),
    ]  # fmt: skip
    assert [name for name, _, _ in checkpointed_modules(model)] == [f"transformer.h.{i}" for i in range(8)]


def test_sqrt_keeps_less_than_plain():
    activations = {}
    for policy in (None, "sqrt", "all"):
        torch.manual_seed(0)
        model = tiny_gpt2(n_layer=9)
        model.config.use_cache = False
        if policy:
            _apply(model, policy=policy)
        tracker = measure.MemoryTracker(module=model)
        b = random_batch(batch_size=2, seq_len=64)
        with tracker:
            with tracker.phase("forward"):
                loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss
            with tracker.phase("backward"):
                loss.backward()
        activations[policy] = tracker.peaks["forward"].by_category["activations"]
    # forward-end activations: "sqrt" keeps 3 segment inputs, "all" 9 block inputs, no checkpointing everything
    assert activations["sqrt"] < activations["all"] < activations[None] / 10


def test_state_dict_keys_unchanged_and_round_trip(tmp_path):
    torch.manual_seed(0)
    plain = _gpt2()
    wrapped = copy.deepcopy(plain)
    _apply(wrapped, policy="sqrt")
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    # save with the callback, load into a model without it ...
    torch.save(wrapped.state_dict(), tmp_path / "wrapped.pt")
    fresh = _gpt2()
    fresh.load_state_dict(torch.load(tmp_path / "wrapped.pt"), strict=True)
    # ... and the reverse
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    fresh_wrapped = _gpt2()
    _apply(fresh_wrapped, policy="all")
    fresh_wrapped.load_state_dict(torch.load(tmp_path / "plain.pt"), strict=True)
    fresh.eval(), fresh_wrapped.eval()
    ids = random_batch(seq_len=8)["input_ids"]
    assert torch.equal(fresh(input_ids=ids).logits, fresh_wrapped(input_ids=ids).logits)


def test_not_applied_twice_and_unwrap():
    model = _gpt2()
    first = _apply(model, policy="all")
    second = _apply(model, policy="selective")
    assert len(first.wrapped) == 4 and second.wrapped == []
    assert _count_block_forwards(model, _hf_loss) == [2, 2, 2, 2]
    for block in model.transformer.h:
        assert remove_checkpointing(block)
        assert "forward" not in block.__dict__ and checkpoint_info(block) is None
    assert _count_block_forwards(model, _hf_loss) == [1, 1, 1, 1]


def test_deepcopy_and_pickle_keep_checkpointing():
    model = _gpt2()
    _apply(model, policy="sqrt")
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert [i.position for _, _, i in checkpointed_modules(clone)] == [0, 1, 0, 1]
        assert _count_block_forwards(clone, _hf_loss) == [2, 2, 2, 2]
    assert ActivationCheckpointing.remove(model) == 4 and not checkpointed_modules(model)
    assert _count_block_forwards(model, _hf_loss) == [1, 1, 1, 1]


@pytest.mark.parametrize("policy", ["all", "sqrt"])
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_eval_and_no_grad_do_not_recompute(policy, grad_mode, monkeypatch):
    """Without autograd (validation, generation) a checkpointed block runs once, outside `checkpoint`, and no
    segment is recorded: the outputs are the plain model's."""
    plain = _gpt2().eval()
    model = copy.deepcopy(plain)
    _apply(model, policy=policy)
    frames = []
    monkeypatch.setattr(torch_internals, "checkpoint_region", lambda *a, **k: frames.append(a) or pytest.fail("checkpoint called"))
    recorded = []
    monkeypatch.setattr(_segments._SegmentRun, "record_call", lambda *a: recorded.append(a))
    ids = random_batch(seq_len=8)["input_ids"]
    out = {}
    with grad_mode():
        counts = _count_block_forwards(model, run=lambda: out.setdefault("logits", model(input_ids=ids).logits))
        want = plain(input_ids=ids).logits
    assert counts == [1, 1, 1, 1]
    assert frames == [] and recorded == []
    assert out["logits"].grad_fn is None and torch.equal(out["logits"], want)


def test_hf_kv_cache_refused_with_fix():
    model = _gpt2()
    _apply(model, policy="all")
    with pytest.raises(RuntimeError, match="use_cache = False"):
        model(input_ids=random_batch(seq_len=8)["input_ids"], use_cache=True)


def test_hf_own_checkpointing_is_turned_off_with_warning():
    model = _gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.warns(UserWarning, match="turning off"):
        _apply(model, policy="all")
    assert not model.is_activation_checkpointing
    assert _count_block_forwards(model, _hf_loss) == [2, 2, 2, 2]  # recomputed once, not twice


def test_discovery_covers_encoder_decoder_and_skips_nested():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=3, num_heads=2))
    names = [n for n, _ in _blocks.find_repeated_blocks(t5)]
    assert names == [f"encoder.block.{i}" for i in range(3)] + [f"decoder.block.{i}" for i in range(3)]
    assert [n for n, _ in _blocks.find_repeated_blocks(EncoderModel())] == [f"encoder.layers.{i}" for i in range(4)]


def test_blocks_override_and_explicit_patterns():
    model = _llama()
    cb = _apply(model, blocks="model.layers.[13]")
    assert cb.wrapped == ["model.layers.1", "model.layers.3"]
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    cb = _apply(mlp, policy=[nn.Linear])
    assert cb.wrapped == ["0", "2"]


# --- bad input -------------------------------------------------------------------------------------


def test_unknown_policy():
    with pytest.raises(ValueError, match=r"Passed `policy='sqrtt'`; expected one of 'all', 'every_n', 'sqrt'"):
        ActivationCheckpointing(policy="sqrtt")
    with pytest.raises(TypeError, match="non-empty list"):
        ActivationCheckpointing(policy=3)
    with pytest.raises(ValueError, match=r"Passed `policy=\[\]`; name at least one"):
        ActivationCheckpointing(policy=[])


@pytest.mark.parametrize("n", [0, -1, None])
def test_every_n_needs_n_at_least_one(n):
    with pytest.raises(ValueError, match=r"`n` must be an integer >= 1"):
        ActivationCheckpointing(policy="every_n", n=n)
    with pytest.raises(TypeError, match=r"Passed `n=1.5`; expected an integer >= 1"):
        ActivationCheckpointing(policy="every_n", n=1.5)


def test_options_of_other_policies_are_refused():
    with pytest.raises(ValueError, match="only used by policy='every_n'"):
        ActivationCheckpointing(policy="all", n=2)
    with pytest.raises(ValueError, match="without `budget`"):
        ActivationCheckpointing(policy="budget")
    with pytest.raises(ValueError, match="only used by policy='budget'"):
        ActivationCheckpointing(policy="sqrt", budget=10)
    with pytest.raises(ValueError, match="Passed `budget` 'lots' that does not parse; expected a number"):
        ActivationCheckpointing(policy="budget", budget="lots")
    # one parser for every size (the CLI's, AccumulationScheduler's): TB, exponents, and a clear error, not a float's
    assert ActivationCheckpointing(policy="budget", budget="1TB").budget == 10**12
    assert ActivationCheckpointing(policy="budget", budget="1e9").budget == 10**9
    with pytest.raises(ValueError, match="does not parse"):
        ActivationCheckpointing(policy="budget", budget="1.2.3GB")


def test_no_repeated_blocks_defers_to_measurement_and_named_blocks_must_exist():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    cb = _apply(mlp)  # nothing wrapped yet: the blocks are chosen by measurement on the first training batch
    assert cb._pending_choice and cb.wrapped == [] and cb.chosen_by_measurement is None
    with pytest.raises(ValueError, match=r"found none of the blocks named by.*blocks='model.layers'.*policy=\['MyBlock'\]"):
        _apply(_gpt2(), blocks="nope.*")


def test_manual_optimization_without_repeated_blocks_is_asked_to_name_them():
    class GAN(nn.Module):
        automatic_optimization = False

        def __init__(self) -> None:
            super().__init__()
            self.generator, self.discriminator, self.act = nn.Linear(2, 4), nn.Linear(4, 1), nn.ReLU()

    with pytest.raises(ValueError, match=r"manual-optimization.*blocks=\['generator', 'discriminator'\]"):
        _apply(GAN())


def _measured(**entries):
    from lightning_lowmem.callbacks.activation_checkpointing.probe import ModuleActivations

    return {name: ModuleActivations(name, i, saved, inputs) for i, (name, (saved, inputs)) in enumerate(entries.items())}


def test_choose_submodules_splits_the_dominant_module_and_skips_the_negligible():
    from lightning_lowmem.callbacks.activation_checkpointing.probe import choose_submodules

    # `body` holds 80% of 1000 bytes: split into its children; `head` frees 0.5%: not worth a wrapper
    measured = _measured(body=(800, 100), **{"body.a": (500, 100), "body.b": (300, 50)}, head=(105, 100))
    assert choose_submodules(nn.Module(), measured, 1000) == ["body.a", "body.b"]
    # no child frees anything (each keeps what it saves as its input): the dominant module itself
    measured = _measured(body=(800, 100), **{"body.a": (100, 100), "body.b": (200, 200)})
    assert choose_submodules(nn.Module(), measured, 1000) == ["body"]
    # a module below half stays whole, in call order
    measured = _measured(enc=(400, 50), dec=(400, 60))
    assert choose_submodules(nn.Module(), measured, 1000) == ["enc", "dec"]


def test_sqrt_refused_under_zero3_and_fsdp_other_policies_compose():
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

    for stage in (1, 2, 3):
        strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
        strategy.config = {"zero_optimization": {"stage": stage}}
        trainer = SimpleNamespace(strategy=strategy)
        for policy in ("all", "selective", "budget"):
            ActivationCheckpointing(policy=policy, **({"budget": "1GiB"} if policy == "budget" else {}))._check_strategy(
                trainer
            )
        if stage < 3:
            ActivationCheckpointing(policy="sqrt")._check_strategy(trainer)
    with pytest.raises(ValueError, match=r"policy='sqrt'.*ZeRO stage 3.*use policy='all'"):
        ActivationCheckpointing(policy="sqrt")._check_strategy(trainer)
    trainer = SimpleNamespace(strategy=ModelParallelStrategy.__new__(ModelParallelStrategy))
    with pytest.raises(ValueError, match="policy='sqrt'.*use policy='all'"):
        ActivationCheckpointing(policy="sqrt")._check_strategy(trainer)
    ActivationCheckpointing(policy="selective")._check_strategy(trainer)  # per-block policies are fine


def test_budget_choice():
    # 4 blocks of 100 bytes with inputs of 10, 50 bytes outside: none checkpointed = 450
    assert choose_for_budget(50, [100] * 4, [10] * 4, 450) == ([], 190)
    chosen, minimum = choose_for_budget(50, [100] * 4, [10] * 4, 300)
    assert len(chosen) == 3 and minimum == 190  # 2 blocks: 50 + 200 + 20 + 100 (recompute) = 370; 3: 280
    assert choose_for_budget(50, [100] * 4, [10] * 4, 189) == (None, 190)
    assert parse_bytes("1GiB") == 2**30 and parse_bytes("512 MB") == 512 * 10**6 and parse_bytes(7) == 7


def test_the_probe_keeps_no_reference_to_the_parameters_of_a_fake_module():
    """The probe's graph and its saves formed a cycle through autograd (invisible to Python's collector) that kept the
    saved parameters alive: in a dry run those are the traced module's own fake ones, which a later ``module.to()``
    swaps, and torch refuses to swap a tensor something else holds."""
    from lightning_lowmem.callbacks.activation_checkpointing.probe import measure_saved_bytes
    from lightning_lowmem.predict.fake import fake_copy, fake_execution
    from tests.helpers.models import tiny_lm_module

    with fake_execution() as fx:
        module = fake_copy(tiny_lm_module(), fx)
        measure_saved_bytes(module, ["model.transformer.h.0", "model.transformer.h.1"], random_batch(1, 8), 0)
        counts = {name: p._use_count() for name, p in module.named_parameters()}
    assert set(counts.values()) == {1}, counts
