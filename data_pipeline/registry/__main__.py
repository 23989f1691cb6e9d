"""The dataset registry's command line (seed 003, "Register a dataset").

Examples, on the smoke data (a throw-away registry in /tmp/registry):

    python -m data_pipeline.registry --registry=/tmp/registry datasets register smoke/chat \\
        -f data/smoke/chat/train.jsonl --format=chat --alias candidate        # prints smoke/chat:v1
    python -m data_pipeline.registry --registry=/tmp/registry datasets register smoke/prepared \\
        -f data/smoke/prepared/train.zip --format=prepared
    python -m data_pipeline.registry --registry=/tmp/registry datasets get smoke/chat:candidate
    python -m data_pipeline.registry --registry=/tmp/registry datasets versions smoke/chat
    python -m data_pipeline.registry --registry=/tmp/registry datasets list --namespace smoke
    python -m data_pipeline.registry --registry=/tmp/registry datasets alias set smoke/chat:candidate 1
    python -m data_pipeline.registry --registry=/tmp/registry images push data/smoke/chat/images/*.png
    python -m data_pipeline.registry --registry=/tmp/registry datasets register smoke/chat \\
        -f data/smoke/chat/eval.jsonl --format=chat --no-upload

The registry is `--registry=URL`, else `$VALEN_REGISTRY`, else ~/.cache/valen/registry: a local
directory, or an fsspec URL for the blobs (gs://bucket/registry) with `--index=PATH` (or
`$VALEN_REGISTRY_INDEX`) for the local SQLite index. `--format` defaults to `prepared` for a .zip
and `chat` otherwise (seed 003's two dataset formats); valen, vflash and vakforge files take it
explicitly. Commands have no default namespace: name it (ns/name).

Exit 0 on success (register prints the version, e.g. smoke/chat:v2); exit 1 with the reason on
stderr when the registry refuses; exit 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from data_pipeline.cli_flags import add_flag
from data_pipeline.format_registry import FORMATS
from data_pipeline.registry.content import MIB
from data_pipeline.registry.core import open_registry
from data_pipeline.registry.references import RegistryError


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: multi-word flags through `cli_flags.add_flag` (hyphens, or underscores)."""
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.registry", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--registry", default=None, help="registry URL or directory (default: $VALEN_REGISTRY, "
                                                          "else ~/.cache/valen/registry)")
    parser.add_argument("--index", default=None, help="local SQLite index for a remote (fsspec) registry")
    add_flag(parser, "--upload-limit-mib", type=float, default=None,
             help="largest upload, and largest extracted zip, in MiB (default 256)")
    groups = parser.add_subparsers(dest="group", required=True)

    datasets = groups.add_parser("datasets").add_subparsers(dest="command", required=True)
    register = datasets.add_parser("register", help="register a file as a new version of NS/NAME")
    register.add_argument("dataset", metavar="NS/NAME")
    register.add_argument("-f", "--file", required=True, type=Path)
    register.add_argument("--format", dest="fmt", choices=tuple(FORMATS), default=None)
    register.add_argument("--alias", default=None)
    add_flag(register, "--no-upload", action="store_true",
             help="upload no images: report those the registry lacks and register nothing")
    datasets.add_parser("get", help="resolve a reference").add_argument("reference", metavar="REF")
    datasets.add_parser("versions").add_argument("dataset", metavar="NS/NAME")
    listing = datasets.add_parser("list")
    listing.add_argument("--namespace", required=True)
    alias = datasets.add_parser("alias").add_subparsers(dest="alias_command", required=True)
    alias_set = alias.add_parser("set", help="point an alias at a version (no upload)")
    alias_set.add_argument("alias", metavar="NS/NAME:ALIAS")
    alias_set.add_argument("version", metavar="VERSION")

    images = groups.add_parser("images").add_subparsers(dest="command", required=True)
    images.add_parser("push").add_argument("paths", nargs="+", metavar="PATH", type=Path)
    return parser


def _default_format(path: Path) -> str:
    return "prepared" if path.suffix.lower() == ".zip" else "chat"


def _run(args: argparse.Namespace) -> None:
    limit = None if args.upload_limit_mib is None else int(args.upload_limit_mib * MIB)
    registry = open_registry(args.registry, index=args.index, upload_limit=limit)
    if args.group == "images":
        for path, digest in zip(args.paths, registry.push_images(args.paths), strict=True):
            print(f"{digest} {path}")
        return
    if args.command == "register":
        resolved = registry.register(args.dataset, args.file, args.fmt or _default_format(args.file),
                                     alias=args.alias, upload=not args.no_upload)
        if not resolved.new:
            print(f"{args.file}: these examples are already {resolved.reference}", file=sys.stderr)
        print(resolved.reference)
    elif args.command == "get":
        resolved = registry.resolve(args.reference)
        print(json.dumps({"reference": resolved.reference, "digest": resolved.digest, "format": resolved.format,
                          "path": str(resolved.path)}, indent=2))
    elif args.command == "versions":
        for row in registry.versions(args.dataset):
            aliases = f" ({', '.join(row['aliases'])})" if row["aliases"] else ""
            print(f"{row['reference']} {row['digest']} {row['format']} {row['size']} bytes{aliases}")
    elif args.command == "list":
        rows = registry.list(args.namespace)
        if not rows:
            raise RegistryError(f"namespace {args.namespace.lower()}: no datasets in the registry {registry.url}")
        for row in rows:
            print(f"{row['dataset']} {row['versions']} versions, latest {row['latest']}")
    elif args.command == "alias":
        resolved = registry.set_alias(args.alias, args.version)
        print(f"{args.alias.lower()} -> {resolved.reference}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _run(args)
    except RegistryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
