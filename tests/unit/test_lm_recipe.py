"""recipes/lm.py: the generated corpus, its windows, the LR schedule, and that the model learns."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
from lm import ALPHABET, CharDataModule, CharLM, decode, generate_corpus, warmup_cosine  # noqa: E402


def test_corpus_is_deterministic_and_inside_the_alphabet():
    text = generate_corpus(5000, seed=3)
    assert len(text) == 5000 and text == generate_corpus(5000, seed=3) and text != generate_corpus(5000, seed=4)
    assert set(text) <= set(ALPHABET)


def test_windows_are_shifted_pairs_with_their_sample_id():
    data = CharDataModule(num_chars=1000, seq_len=16, batch_size=4)
    data.setup()
    assert len(data.dataset) == (1000 - 1) // 16
    inputs, targets, sample_id = data.dataset[5]
    assert sample_id == 5 and inputs.shape == targets.shape == (16,)
    assert decode(inputs)[1:] == decode(targets)[:-1]
    assert decode(inputs) == data.text[80:96]
    assert (
        data.fingerprint
        == CharDataModule(num_chars=1000, seq_len=16).fingerprint
        != CharDataModule(num_chars=1000, corpus_seed=1).fingerprint
    )


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    shape = [warmup_cosine(step, warmup_steps=4, decay_steps=20, min_lr_ratio=0.1) for step in range(25)]
    assert shape[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(shape[4:], shape[5:]))
    assert shape[20] == pytest.approx(0.1) and shape[24] == pytest.approx(0.1)


def test_initial_weights_do_not_depend_on_the_global_rng():
    torch.manual_seed(1)
    first = CharLM(vocab_size=len(ALPHABET)).state_dict()
    torch.manual_seed(2)
    second = CharLM(vocab_size=len(ALPHABET)).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_model_learns_the_corpus_in_a_few_steps():
    torch.manual_seed(0)
    data = CharDataModule(num_chars=20_000, seq_len=32, batch_size=16)
    model = CharLM(vocab_size=data.vocab_size, seq_len=32, warmup_steps=3, decay_steps=30)
    optimizer = model.configure_optimizers()["optimizer"]
    loader = iter(data.train_dataloader())
    losses = []
    for _ in range(25):
        inputs, targets, _ = next(loader)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 3.0  # ~ln(33): uniform over the alphabet
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8, losses


def test_frozen_modules_get_no_gradients_and_no_optimizer_state():
    model = CharLM(vocab_size=len(ALPHABET), d_model=16, n_layers=2, n_heads=2, freeze=["tok_emb", "blocks.0"])
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(name.startswith(("net.tok_emb.", "net.blocks.0.")) for name in frozen)
    assert "net.blocks.1.qkv.weight" not in frozen and "net.pos_emb.weight" not in frozen
    optimizer = model.configure_optimizers()["optimizer"]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}


def test_freezing_an_unknown_module_names_the_option_and_the_known_modules():
    with pytest.raises(ValueError, match=r"model.freeze names no module of the model: 'blocks.9'.*tok_emb"):
        CharLM(vocab_size=len(ALPHABET), d_model=16, n_heads=2, freeze=["blocks.9"])
