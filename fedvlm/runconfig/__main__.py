"""Inspect and check run configs without starting Flower.

    python -m fedvlm.runconfig keys                       # every key, its default and meaning (Markdown)
    python -m fedvlm.runconfig toml                       # the pyproject.toml config section
    python -m fedvlm.runconfig check -c "method='coop' prompt.lr=0.01"   # validate overrides

Flower itself refuses an override whose key is not in pyproject.toml with only "Invalid run
configuration"; `check` names the key and suggests the closest one.
"""

from __future__ import annotations

import argparse
import sys

from flwr.common.config import parse_config_args

from fedvlm.methods.registry import validate
from fedvlm.runconfig import ConfigError
from fedvlm.runconfig.schema import KEYS


def keys_markdown() -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for k in KEYS:
        default = (
            repr(k.default)
            if isinstance(k.default, str)
            else str(k.default).lower()
            if isinstance(k.default, bool)
            else k.default
        )
        extra = f" One of: {', '.join(f'`{c}`' for c in k.choices)}." if k.choices else ""
        rows.append(f"| `{k.name}` | `{default}` | {k.help}{extra} |")
    return "\n".join(rows)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def toml_section() -> str:
    """The body of pyproject's [tool.flwr.app.config]: every key, its help, its default."""
    lines = []
    for k in KEYS:
        lines.append(f"# {k.help}")
        lines.append(f"{k.name} = {_toml_value(k.default)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedvlm.runconfig")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("keys", help="print every key as a Markdown table")
    sub.add_parser("toml", help="print the [tool.flwr.app.config] section for pyproject.toml")
    check = sub.add_parser("check", help="validate run-config overrides")
    check.add_argument(
        "-c",
        "--run-config",
        action="append",
        default=None,
        help="overrides as for `flwr run --run-config`, or a .toml file",
    )
    args = parser.parse_args(argv)
    if args.cmd == "keys":
        print(keys_markdown())
        return 0
    if args.cmd == "toml":
        print(toml_section())
        return 0
    try:
        cfg = validate(parse_config_args(args.run_config))
    except ConfigError as err:
        print(f"invalid run config: {err}", file=sys.stderr)
        return 2
    for k, v in cfg.as_dict().items():
        print(f"{k} = {v!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
