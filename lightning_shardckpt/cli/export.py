"""`shardckpt export`: one torch or safetensors file (or shards) of a checkpoint's global tensors."""

from __future__ import annotations

import argparse
import re
from typing import Any

from ..ops.choices import EXPORT_DTYPES, EXPORT_FORMATS, SAFETENSORS
from . import exit_codes, options
from .options import add_public_key, require_signed
from .output import human_bytes, print_json

_SIZE = re.compile(r"^(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]?i?B?)$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def add_commands(commands: Any) -> None:
    export = commands.add_parser(
        "export",
        parents=[options.common()],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EXPORT_EPILOG,
        help="write a checkpoint's tensors as one torch or safetensors artifact",
    )
    export.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory, a root (its latest) or ROOT/latest")
    export.add_argument("out", metavar="OUT", help="the file to write (a directory with --max-shard-size)")
    export.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default=SAFETENSORS,
        help="safetensors: the tensors by name, no code on load (Hugging Face, vLLM; default); torch: one "
        "torch.save file of a {name: tensor} dict, for torch.load(weights_only=True)",
    )
    export.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="safetensors shards of at most SIZE (e.g. 5GB, 500MiB) plus model.safetensors.index.json",
    )
    export.add_argument(
        "--model-only", action="store_true", help="only the model's tensors (model.*), no optimizer state"
    )
    export.add_argument(
        "--dtype", choices=EXPORT_DTYPES, default=None, help="cast floating tensors (default: as saved, bit-exact)"
    )
    export.add_argument(
        "--prefix", default=None, help="strip this from every tensor name that starts with it, e.g. model."
    )
    export.add_argument(
        "--replace",
        action="store_true",
        help="replace an existing OUT (shards as a whole: the old ones go once the new index is in place)",
    )
    add_public_key(export, "exporting")
    export.add_argument(
        "--sign-key-path",
        default=None,
        metavar="PEM",
        help="sign OUT into OUT.sig with this ECDSA (P-256/384/521) private key, in OpenSSF model-signing's format: "
        "check it with `model_signing verify key OUT --signature OUT.sig --public_key PUB` (offline)",
    )
    export.set_defaults(run=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from ..engine.root import open_reference
    from ..ops.export import ExportOptions, export_checkpoint  # here: torch, which --help must not wait for

    if args.public_key:  # every byte exported comes from a checkpoint an accepted key signed
        require_signed(
            *open_reference("latest", args.checkpoint, args.storage_options), args.public_key, args.revoked_key
        )

    options = ExportOptions(
        format=args.format,
        max_shard_size=args.max_shard_size,
        model_only=args.model_only,
        dtype=args.dtype,
        prefix=args.prefix,
        storage_options=args.storage_options,
        replace=args.replace,
        sign_key_path=args.sign_key_path,
    )
    result = export_checkpoint(args.checkpoint, args.out, options)
    if args.json:
        print_json(result.to_dict())
    else:
        print(
            f"exported {result.checkpoint}: {result.tensors} tensors, {human_bytes(result.bytes_written)} "
            f"in {result.seconds:.2f}s ({human_bytes(result.bytes_read)} read and checksummed)"
        )
        for path in result.files:
            print(f"  {path}")
        if result.signature:
            print(f"signed: {result.signature} (OpenSSF model-signing bundle)")
    return exit_codes.OK


def parse_size(text: str) -> int:
    """`5GB`, `500MiB`, `1000000` -> bytes (GB = 10^9, GiB = 2^30, as Hugging Face reads them)."""
    match = _SIZE.match(text.strip())
    if match is None or match["unit"].upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 5GB, 500MiB or a number of bytes")
    size = int(float(match["number"]) * _UNITS[match["unit"].upper()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte; write e.g. 5GB, 500MiB or a number of bytes")
    return size


_EXPORT_EPILOG = """\
OUT must not exist (--replace replaces it) and must lie outside any checkpoint root.
Tensors only (model and, without --model-only, optimizer state), by their checkpoint names (model.layer.weight,
optimizers.0.state.layer.weight.exp_avg), minus --prefix. Every byte read is checked against the manifest;
memory stays near the largest tensor. Loads with torch.load(OUT, weights_only=True) or
safetensors.torch.load_file(OUT).
examples:
  shardckpt export /data/ckpt/run-7 model.safetensors --model-only --prefix model.
  shardckpt export s3://bucket/run-7/latest out/ --max-shard-size 5GB --dtype bf16 --model-only --prefix model.
  shardckpt export /data/ckpt/run-7/step-000001000-2f72c10f8c75 full.pt --format torch
  shardckpt export /data/ckpt/run-7 model.safetensors --model-only --public-key run.pub --sign-key-path release.pem
"""
