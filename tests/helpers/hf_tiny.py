"""Tiny Hugging Face causal LMs built from a config (nothing is downloaded: the hub is switched off before
transformers is imported), and the FSDP units a wrapped model has.

`LlamaForCausalLM` keeps its decoder layers in `model.layers` under the backbone `model`; `GPT2LMHeadModel` keeps
them in `transformer.h` and ties `lm_head.weight` to `transformer.wte.weight`."""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # set before the import: huggingface_hub reads it once; a test never downloads
# scripts/setup_env.sh installs transformers beside the venv, not in it (torchmetrics would import it in every
# Lightning process); appended, so what the venv has wins over the copies of shared dependencies there
HF_SITE = os.path.join(sys.prefix, "hf-site")
if not os.path.isdir(HF_SITE):
    raise ImportError(f"{HF_SITE} is missing: transformers for the HF tests; run `bash scripts/setup_env.sh`")
if HF_SITE not in sys.path:
    sys.path.append(HF_SITE)

import torch  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

# transformers (~1.7 CPU-s) is imported by the builders: every pytest worker collects the modules that import this
# one, and only the worker that runs their tests should pay for it

VOCAB = 32


def tiny_llama(seed: int) -> torch.nn.Module:
    """A 2-layer Llama (grouped-query attention, untied head); parameters drawn from `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
    )
    return LlamaForCausalLM(config)


def tiny_gpt2(seed: int) -> torch.nn.Module:
    """A 2-layer GPT-2 (its head tied to the token embedding), without dropout; parameters drawn from `seed`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=1,
    )
    return GPT2LMHeadModel(config)


def token_ids(seed: int) -> torch.Tensor:
    """A batch of 2 sequences of 8 token ids below the vocabulary size."""
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def fsdp_units(module: torch.nn.Module) -> list[str]:
    """The names of the modules `fully_shard` was applied to ("" is the root): each one is an FSDP unit, whose
    parameters are gathered and freed together."""
    return sorted(name for name, child in module.named_modules() if isinstance(child, FSDPModule))
