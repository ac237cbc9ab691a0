"""The names and defaults operator commands show in `--help`, apart from the code behind them.

`shardckpt --help` must answer without importing torch (about a second on a laptop); the modules that
implement export and bisect import it, so what the parser needs of them lives here.
"""

TORCH, SAFETENSORS = "torch", "safetensors"
EXPORT_FORMATS = (TORCH, SAFETENSORS)
EXPORT_DTYPES = ("bf16", "fp16", "fp32")  # floating tensors cast on export (export.py maps them to torch dtypes)
BISECT_TOP = 10  # tensors listed in the affected slice's ranking
