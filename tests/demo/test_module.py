import lightning as L
import pytest
import torch

from lightning_lowmem.demo.module import CausalLMModule, build_causal_lm
from lightning_lowmem.demo.tokenizer import ByteTokenizer
from tests.helpers.models import GPT2_TINY, random_batch, tiny_gpt2, tiny_lm_module


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é' * x\n"
    ids = tok.encode(text, add_eos=True)
    assert ids[-1] == tok.eos_token_id and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_builds_from_config_with_byte_vocab(model_type):
    module = tiny_lm_module(model_type)
    assert module.model.config.vocab_size == ByteTokenizer.vocab_size
    logits = module(random_batch()["input_ids"])
    assert logits.shape == (2, 32, ByteTokenizer.vocab_size)


def test_loss_is_mean_over_labelled_tokens():
    module = tiny_lm_module().eval()  # no dropout: the two forwards must match
    batch = random_batch(seq_len=16)
    batch["labels"][0, 8:] = -100  # padding: ignored
    loss_sum, n = module.loss_sum_and_tokens(batch)
    assert n.item() == 2 * 15 - 8  # shifted: 15 targets per row, 8 of row 0 ignored
    reference = module.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss  # HF's own mean
    torch.testing.assert_close(loss_sum / n, reference)


def test_sum_reduction_returns_token_count():
    module = tiny_lm_module(loss_reduction="sum")
    out = module.training_step(random_batch(), 0)
    assert set(out) == {"loss", "num_tokens"} and out["num_tokens"].item() == 2 * 31


def test_from_pretrained_local_directory(tmp_path):
    model = tiny_gpt2()
    model.save_pretrained(tmp_path)
    module = CausalLMModule(pretrained_path=str(tmp_path))
    for (name, p), q in zip(module.model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_a_saved_model_fine_tunes_in_train_mode(tmp_path):
    """Issue 48 item 8: ``from_pretrained`` returns the model in eval mode; Lightning keeps each module's mode, so the
    fine-tune ran with dropout off ("Found 60 module(s) in eval mode")."""
    tiny_gpt2(dropout=0.1).save_pretrained(tmp_path)
    module = CausalLMModule(pretrained_path=str(tmp_path))
    assert all(m.training for m in module.modules())


def test_a_saved_vocabulary_smaller_than_the_datas_is_refused_at_setup(tmp_path):
    """Issue 48 item 8: a model saved with 256 token ids on the byte tokenizer's 258 crashed mid-run with an
    IndexError (the first batch holding an end-of-text id); refused before the first step, naming both sizes."""
    from lightning_lowmem.demo.data import StdlibTextDataModule

    tiny_gpt2(vocab_size=256).save_pretrained(tmp_path)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"gives 258 token ids, but the model embeds 256 \(its `vocab_size`\).*"
                                         r"resize_token_embeddings\(258\)"):
        trainer.fit(CausalLMModule(pretrained_path=str(tmp_path)),
                    datamodule=StdlibTextDataModule(seq_len=16, batch_size=2, max_bytes=5000))


def test_bad_model_inputs():
    with pytest.raises(ValueError, match=r"Passed `model_type='t5'`.*causal LM"):
        build_causal_lm("t5", {})
    with pytest.raises(FileNotFoundError, match=r"Passed `pretrained_path='/no/such/dir'`"):
        build_causal_lm(pretrained_path="/no/such/dir")
    with pytest.raises(ValueError, match="loss_reduction"):
        CausalLMModule(config=GPT2_TINY, loss_reduction="avg")


@pytest.mark.integration
def test_loss_goes_down_on_stdlib_text():
    from lightning_lowmem.demo.data import StdlibTextDataModule

    L.seed_everything(0)
    module = tiny_lm_module(learning_rate=3e-3)
    data = StdlibTextDataModule(seq_len=64, batch_size=8, max_bytes=100_000)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", max_steps=40, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[Record()],
    )
    trainer.fit(module, data)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)  # byte-level LM: ~5.5 nats at random init


def test_batch_longer_than_the_learned_positions_is_a_clear_error():
    import pytest
    import torch

    from lightning_lowmem.demo.module import CausalLMModule

    module = CausalLMModule(config={"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 16})
    assert module.max_positions == 16
    module(torch.zeros(1, 16, dtype=torch.long))  # the limit itself is fine
    with pytest.raises(ValueError, match=r"The batch has sequences of 17 tokens.*at most 16 positions.*n_positions: 17"):
        module(torch.zeros(1, 17, dtype=torch.long))
    llama = CausalLMModule(model_type="llama", config={"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                                                        "num_attention_heads": 2, "max_position_embeddings": 16})
    assert llama.max_positions is None  # rotary positions: no hard limit, no refusal
    llama(torch.zeros(1, 17, dtype=torch.long))
