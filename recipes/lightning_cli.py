"""The LightningCLI front door (the Hydra one is recipes/train.py): the same model, data and checkpoints.

python recipes/lightning_cli.py fit --config recipes/lightning_cli.yaml                  # 2 CPU ranks
python recipes/lightning_cli.py fit --config recipes/lightning_cli.yaml --print_config   # every option, typed
# continue on 1 rank (max_steps counts the whole run: raise it to train on)
python recipes/lightning_cli.py fit --config recipes/lightning_cli.yaml --trainer.devices 1 --trainer.max_steps 80 --ckpt_path latest
"""

from lightning.pytorch.cli import LightningCLI
from lm import CharDataModule, CharLM

from lightning_shardckpt import ShardedCheckpoint


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ShardedCheckpoint, "checkpoint")  # --checkpoint.save.async_save false, ...
        parser.link_arguments("data.seq_len", "model.seq_len")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


if __name__ == "__main__":
    CLI(CharLM, CharDataModule, save_config_kwargs={"overwrite": True})  # a resume rewrites the run's config.yaml
