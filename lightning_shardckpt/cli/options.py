"""Options every `shardckpt` command takes (--json, --storage-option), and the KEY=VALUE parser behind them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

from ..engine.validate import require_number
from ..errors import ConfigError


def common() -> argparse.ArgumentParser:
    """The parent parser of every command: `commands.add_parser(NAME, parents=[common()], ...)`."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument(
        "--storage-option",
        dest="storage_option",
        metavar="KEY=VALUE",
        action="append",
        type=storage_option,
        default=[],
        help="passed to fsspec (repeatable); VALUE is parsed as JSON when it can be, e.g. anon=true",
    )
    return parser


def storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. endpoint_url=http://localhost:9000)")
    try:
        return key, json.loads(value)  # true, 3, {"region_name": "x"} keep their types
    except json.JSONDecodeError:
        return key, value


def number(flag: str, **rules: Any) -> Callable[[str], Any]:
    """An argparse `type=` for a numeric flag, checked by the options' own validator (engine/validate.py):
    `number("--tolerance", at_least=0)`. A bad value exits 2 with the usage line and the flag's rule."""

    def parse(text: str) -> Any:
        value: Any = text
        for convert in (int, float):
            try:
                value = convert(text)
                break
            except ValueError:
                continue
        try:
            return require_number(flag, value, **rules)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = "integer" if rules.get("integer") else "number"  # argparse names it in "invalid ... value"
    return parse


WINDOW_HELP = (
    "; PEM,not_after_step=N and/or ,not_after=TIME (ISO 8601, UTC unless zoned) accepts the key only on checkpoints "
    "up to step N / created by TIME (a retired key)"
)
REVOKED_HELP = (
    "refuse checkpoints signed by this key at every step, even where --public-key lists it: its key id (16 to 64 hex "
    "characters, as a refusal prints it) or its PEM public key file; repeatable"
)


def add_public_key(parser: argparse.ArgumentParser, what: str, help: str | None = None) -> None:
    """`--public-key PEM[,not_after_step=N][,not_after=TIME]` and `--revoked-key KEY` (both repeatable): the
    signature policy of LoadConfig's public_keys and revoked_keys, on the command line. `help`: the command's own
    words for --public-key (default: require the checkpoint(s) to be signed by one of these keys before `what`)."""
    parser.add_argument(
        "--public-key",
        action="append",
        default=[],
        metavar="PEM",
        type=public_key_entry,
        help=(
            help
            or f"before {what}, require a signature by this Ed25519 public key and every file to match the signed "
            "digests (refused: one line naming the file and key, exit 2); repeat for several accepted keys (rotation)"
        )
        + WINDOW_HELP,
    )
    parser.add_argument(
        "--revoked-key", action="append", default=[], metavar="KEY", type=revoked_key_entry, help=REVOKED_HELP
    )


def public_key_entry(text: str) -> Any:
    """`--public-key`'s value: a PEM file, or `PEM,not_after_step=N,not_after=TIME` (an AcceptedKey, checked)."""
    from ..engine.format.signing import public_key_argument

    try:
        return public_key_argument(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def revoked_key_entry(text: str) -> str:
    """`--revoked-key`'s value, checked now: a key id (hex) or a readable PEM public key file."""
    from ..engine.format.signing import revoked_key_ids

    try:
        revoked_key_ids(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def require_signed(location: Any, entry: Any, public_keys: list[Any], revoked_keys: Sequence[str] = ()) -> None:
    """Raise SignatureRefused (one line, naming the file and key) unless `entry` is signed by one of `public_keys`
    (within its window) and by none of `revoked_keys`."""
    if not public_keys:
        return
    from ..engine.format.signing import require_signed as check

    check(location.fs, entry.path, entry.manifest, public_keys, revoked_keys)
