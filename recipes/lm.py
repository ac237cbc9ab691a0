"""A small character-level language model and its data, sized to train in seconds on CPU ranks.

Used by `recipes/train.py` (see `conf/model/default.yaml`, `conf/data/default.yaml`):

    python recipes/train.py                    # 2 CPU ranks, DDP
    python recipes/train.py strategy=fsdp      # 2 CPU ranks, FSDP2 (`fully_shard` per block and on the root)

The corpus is generated in code from a seeded toy grammar, so every rank and every run sees the same
bytes without shipping a data file, and its fingerprint identifies it in checkpoint manifests.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

# Fixed alphabet: the vocabulary never depends on the corpus, so a checkpoint's embedding shape does not either.
ALPHABET = "\n !',.?abcdefghijklmnopqrstuvwxyz"


# --------------------------------------------------------------------------------------------- data

_SUBJECTS = [
    "the fox",
    "a small bird",
    "the old miller",
    "my sister",
    "the river",
    "a tired horse",
    "the wind",
    "our teacher",
]
_VERBS = ["sees", "follows", "finds", "carries", "remembers", "paints", "crosses", "hears"]
_OBJECTS = [
    "the bridge",
    "a red lantern",
    "the quiet field",
    "an apple",
    "the long road",
    "a letter",
    "the harbour",
    "some bread",
]
_ADVERBS = ["slowly", "at dawn", "every morning", "without a word", "again", "in the rain", "by the mill", "with care"]
_ENDINGS = [".", ".", ".", "!", "?"]


def generate_corpus(num_chars: int, seed: int) -> str:
    """Deterministic English-like text from a toy grammar: learnable structure, no licence questions."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_chars:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.6:
            sentence += f" {rng.choice(_ADVERBS)}"
        if rng.random() < 0.25:
            sentence += f", and {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        sentence += rng.choice(_ENDINGS) + ("\n" if rng.random() < 0.15 else " ")
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:num_chars]


def encode(text: str) -> torch.Tensor:
    index = {ch: i for i, ch in enumerate(ALPHABET)}
    try:
        return torch.tensor([index[ch] for ch in text], dtype=torch.long)
    except KeyError as err:
        raise ValueError(f"character {err.args[0]!r} is not in the model's alphabet {ALPHABET!r}") from err


def decode(ids: torch.Tensor) -> str:
    return "".join(ALPHABET[i] for i in ids.tolist())


class CharWindows(Dataset):
    """Non-overlapping windows of `seq_len + 1` characters: (input, target shifted by one, sample id)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.count = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, sample_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        start = sample_id * self.seq_len
        chunk = self.tokens[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:], sample_id


class CharDataModule(pl.LightningDataModule):
    """The generated corpus, cut into windows; the distributed sampler is Lightning's (added per rank)."""

    def __init__(
        self,
        *,
        num_chars: int = 200_000,
        corpus_seed: int = 0,
        seq_len: int = 64,
        batch_size: int = 16,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        for name, value, low in (("num_chars", num_chars, 2), ("seq_len", seq_len, 1), ("batch_size", batch_size, 1)):
            if value < low:
                raise ValueError(f"data.{name}={value} must be >= {low}")
        if num_chars <= seq_len:
            raise ValueError(f"data.num_chars={num_chars} leaves no window of data.seq_len={seq_len}; raise num_chars")
        self.num_chars, self.corpus_seed, self.seq_len = num_chars, corpus_seed, seq_len
        self.batch_size, self.num_workers, self.shuffle = batch_size, num_workers, shuffle
        self.vocab_size = len(ALPHABET)
        self.dataset: CharWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.dataset is None:
            self.text = generate_corpus(self.num_chars, self.corpus_seed)
            self.dataset = CharWindows(encode(self.text), self.seq_len)

    @property
    def fingerprint(self) -> str:
        """Identifies the data (generator inputs + alphabet) without materialising it; goes into manifests."""
        spec = f"charlm-grammar-v1|{self.num_chars}|{self.corpus_seed}|{self.seq_len}|{ALPHABET}"
        return hashlib.sha256(spec.encode()).hexdigest()[:16]

    def train_dataloader(self) -> DataLoader:
        self.setup()
        # shuffle=True: Lightning swaps in a DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED) per rank.
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


# -------------------------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP; the unit FSDP2 shards."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, time, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, time, width))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        seq_len: int,
        mlp_ratio: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)  # untied: tying across FSDP2 units complicates sharding

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def warmup_cosine(step: int, *, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over `warmup_steps`, cosine down to `min_lr_ratio` at `decay_steps`, flat after."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CharLM(pl.LightningModule):
    """Causal character LM; AdamW with warmup + cosine; FSDP2 per block and on the root under the fsdp strategy."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int = 64,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        decay_steps: int = 200,
        min_lr_ratio: float = 0.1,
        init_seed: int | None = 0,
        freeze: Sequence[str] = (),
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(
                f"model.d_model={d_model} is not divisible by model.n_heads={n_heads}; pick n_heads dividing d_model"
            )
        if warmup_steps < 0 or decay_steps < 0:
            raise ValueError(
                f"model.warmup_steps={warmup_steps} and model.decay_steps={decay_steps} must be >= 0 (steps)"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"model.min_lr_ratio={min_lr_ratio} is outside [0, 1]")
        self.save_hyperparameters()
        # Same initial weights on every rank and every world size, whatever else consumed the global RNG.
        with torch.random.fork_rng(devices=[]):
            if init_seed is not None:
                torch.manual_seed(init_seed)
            self.net = CharTransformer(
                vocab_size=vocab_size,
                d_model=d_model,
                n_layers=n_layers,
                n_heads=n_heads,
                seq_len=seq_len,
                mlp_ratio=mlp_ratio,
                dropout=dropout,
            )
        freeze_modules(self.net, freeze)

    def configure_model(self) -> None:
        mesh = self.device_mesh  # set by Lightning's ModelParallelStrategy (our fsdp); None under DDP
        if mesh is None:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.net, FSDPModule):  # configure_model may run more than once (fit, then validate, ...)
            return
        dp_mesh = _data_parallel_mesh(mesh)
        for block in self.net.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self.net, mesh=dp_mesh)  # the root: embeddings, final norm and head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        inputs, targets, _sample_ids = batch
        logits = self(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        # sync_dist: the logged loss is the mean over all ranks' batches, so it is comparable across world sizes.
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0])
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if not param.requires_grad:  # frozen (model.freeze): no gradient, no optimizer state, never changes
                continue
            (no_decay if param.ndim < 2 or name.endswith("_emb.weight") else decay).append(param)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=tuple(hp.betas),
        )
        schedule = lambda step: warmup_cosine(  # noqa: E731
            step, warmup_steps=hp.warmup_steps, decay_steps=hp.decay_steps, min_lr_ratio=hp.min_lr_ratio
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def freeze_modules(net: nn.Module, names: Sequence[str]) -> None:
    """Stop training the named submodules of the transformer (`model.freeze=[tok_emb,blocks.0]`), as a
    fine-tune of a pretrained base would. Their parameters then never change, which is what lets an
    incremental checkpoint (`checkpoint.save.incremental=true`) reference them instead of writing them."""
    modules = dict(net.named_modules())
    unknown = [name for name in names if not name or name not in modules]
    if unknown:
        known = ", ".join(name for name in modules if name and name.count(".") <= 1)
        raise ValueError(
            f"model.freeze names no module of the model: {', '.join(map(repr, unknown))}; use some of: {known}"
        )
    for name in names:
        for param in modules[name].parameters():
            param.requires_grad_(False)


def _data_parallel_mesh(mesh):
    """The mesh dimension FSDP shards over: the whole mesh if 1-D, else Lightning's "data_parallel" dimension."""
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        return mesh
    if "data_parallel" in names:
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"the device mesh has tensor_parallel={mesh['tensor_parallel'].size()}, but this model applies no tensor "
                "parallelism; set strategy.tensor_parallel_size=1 and strategy.data_parallel_size=<world size>"
            )
        return mesh["data_parallel"]
    raise ValueError(
        f"cannot tell which dimension of the device mesh {names} is data-parallel; name it 'data_parallel'"
    )


# -------------------------------------------------------------------------------------- drill probe

PROBE_TEXT = "the fox sees the bridge slowly, and the wind hears a letter. "


def probe(model_state: dict[str, torch.Tensor]) -> float:
    """Restore-drill probe (`checkpoint.drill.probe: lm:probe`): the loss of one fixed sentence.

    Rebuilds the transformer from the state dict's own shapes (so it needs no config), loads the
    weights and returns the cross-entropy of PROBE_TEXT. The callback records it at save time; a drill
    recomputes it on the restored weights and compares. One head: the head count changes no parameter
    shape, and the same function runs at save and at drill time.
    """
    state = {name.removeprefix("net."): value for name, value in model_state.items()}
    vocab_size, d_model = state["tok_emb.weight"].shape
    seq_len = state["pos_emb.weight"].shape[0]
    n_layers = len({name.split(".")[1] for name in state if name.startswith("blocks.")})
    mlp_ratio = state["blocks.0.mlp.0.weight"].shape[0] // d_model
    net = CharTransformer(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=1,
        seq_len=seq_len,
        mlp_ratio=mlp_ratio,
        dropout=0.0,
    )
    net.load_state_dict(state)
    ids = encode(PROBE_TEXT)[: seq_len + 1]
    with torch.no_grad():
        logits = net.eval()(ids[:-1].unsqueeze(0))
        return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[1:]))
