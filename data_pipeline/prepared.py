"""Describe prepared token rows: read every row, write prepared.json and the zip to register.

Seed 003, "Prepared token rows": `describe` reads every row of each Parquet file (refusing a row a
run would refuse), records the tokenizer's repository, full commit and digests, and the files in
training order with their SHA-256 and counts. The descriptor goes to stdout; with --zip it is also
written, with the files, into the zip to register.

Example (the repository's test tokenizer; a Hugging Face repository name works the same way):

    python -c "import pyarrow as pa, pyarrow.parquet as pq; pq.write_table(pa.table({'input_ids': [[1, 2, 3]], 'loss_mask': [[0, 1, 1]]}), '/tmp/train.parquet')"
    python -m data_pipeline.prepared describe --tokenizer=data/tokenizer \\
        --repository=valen/smoke --revision=0123456789abcdef0123456789abcdef01234567 \\
        --zip=/tmp/train.zip /tmp/train.parquet
    python -m data_pipeline.validate --format=prepared /tmp/train.zip

The tokenizer is loaded exactly as shipped (`AutoTokenizer.from_pretrained`), NOT through
`data_pipeline.tokenizer.load_tokenizer`: that one adds primitive tokens and may install a training
chat template, which changes both digests, so a run comparing them with the base model's shipped
tokenizer would refuse the rows.

Where the tokenizer's commit comes from: a 40-hex --revision is used as given; a branch or tag is
resolved through the Hugging Face cache the tokenizer was loaded into; a local folder inside that
cache (`models--ORG--NAME/snapshots/COMMIT`) names its repository and commit itself; any other local
folder needs --repository and a full --revision.

Exit 0 with the descriptor on stdout; 1 with one `PATH:ROW: FIELD: message` line per problem on
stderr; 2 for a usage error (tokenizer not loadable, commit not resolvable, repeated file names).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from data_pipeline.formats.errors import FILE_FIELD, Problem
from data_pipeline.formats.prepared import (
    COMMIT,
    PreparedDescriptor,
    PreparedFile,
    file_sha256,
    write_prepared_zip,
)
from data_pipeline.formats.prepared_rows import scan_rows

# Hugging Face hub cache layout: models--ORG--NAME/snapshots/COMMIT/.
SNAPSHOT = re.compile(r"models--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})(/|$)")


class UsageError(Exception):
    """A command line that cannot describe anything; exit 2."""


def resolve_source(tokenizer: str, repository: str | None, revision: str | None) -> tuple[str, str]:
    """(repository, full commit) that the descriptor records for `tokenizer`."""
    local = Path(tokenizer)
    if local.is_dir():
        found = SNAPSHOT.search(local.resolve().as_posix() + "/")
        cached_repo = found["repo"].replace("--", "/") if found else None
        cached_commit = found["commit"] if found else None
        repository = repository or cached_repo
        if repository is None:
            raise UsageError(f"{tokenizer} is a local folder: name its model repository with --repository")
        if revision is None and cached_commit is None:
            raise UsageError(
                f"{tokenizer} is a local folder: give the full commit it came from with --revision"
            )
        if revision is not None and not COMMIT.fullmatch(revision):
            raise UsageError(
                f"--revision={revision}: a local folder cannot resolve a branch or tag; give the commit"
            )
        if revision is not None and cached_commit not in (None, revision):
            raise UsageError(
                f"--revision={revision}, but {tokenizer} is the snapshot of commit {cached_commit}"
            )
        return repository, revision or cached_commit
    if repository not in (None, tokenizer):
        raise UsageError(f"--repository={repository}, but the tokenizer is loaded from {tokenizer}")
    if revision is not None and COMMIT.fullmatch(revision):
        return tokenizer, revision
    from huggingface_hub import try_to_load_from_cache

    # After from_pretrained, the cache maps the branch or tag to the commit that was loaded.
    cached = try_to_load_from_cache(tokenizer, "tokenizer_config.json", revision=revision or "main")
    found = SNAPSHOT.search(Path(cached).as_posix()) if isinstance(cached, str) else None
    if found is None:
        raise UsageError(
            f"cannot resolve {tokenizer}@{revision or 'main'} to a commit; pass --revision=COMMIT"
        )
    return tokenizer, found["commit"]


def load_shipped_tokenizer(tokenizer: str, revision: str | None):
    """The tokenizer as the repository ships it: no added tokens, its own chat template."""
    from transformers import AutoTokenizer

    kwargs = {} if Path(tokenizer).is_dir() or revision is None else {"revision": revision}
    try:
        loaded = AutoTokenizer.from_pretrained(tokenizer, **kwargs)
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot load tokenizer {tokenizer}: {err}") from None
    if not getattr(loaded, "is_fast", False):
        raise UsageError(f"{tokenizer}: a fast tokenizer is required (its digest is of backend_tokenizer)")
    if not isinstance(loaded.chat_template, str):
        raise UsageError(f"{tokenizer}: ships no single chat template to record")
    return loaded


def describe(
    files: Sequence[str | Path], tokenizer: str, repository: str | None = None, revision: str | None = None
) -> tuple[PreparedDescriptor | None, list[Problem]]:
    """The descriptor of `files` in training order, or the problems of their rows."""
    from data_pipeline.tokenizer import sha256_text

    names = [Path(f).name for f in files]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"files share a name inside the zip: {', '.join(repeated)}")
    loaded = load_shipped_tokenizer(tokenizer, revision)
    repository, commit = resolve_source(tokenizer, repository, revision)
    problems: list[Problem] = []
    entries = []
    for path, name in zip(files, names, strict=True):
        if not Path(path).is_file():
            problems.append(
                Problem(str(path), 0, FILE_FIELD, "not a file" if Path(path).exists() else "no such file")
            )
            continue
        # len(tokenizer) counts added tokens too; an id past it names no token of this tokenizer.
        stats, found = scan_rows(path, str(path), vocab_size=len(loaded))
        problems += found
        if stats is not None and not found:
            entries.append(PreparedFile(name, file_sha256(path), stats))
    if problems:
        return None, problems
    descriptor = PreparedDescriptor(
        repository,
        commit,
        sha256_text(loaded.backend_tokenizer.to_str()),
        sha256_text(loaded.chat_template),
        tuple(entries),
    )
    return descriptor, []


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`: one-word flags only (a multi-word one goes through `cli_flags.add_flag`)."""
    parser = argparse.ArgumentParser(
        prog="python -m data_pipeline.prepared",
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("describe", help="read every row and write prepared.json (and --zip)")
    cmd.add_argument("--tokenizer", required=True, help="Hugging Face repository name or local folder")
    cmd.add_argument("--repository", help="model repository the tokenizer comes from (local folders)")
    cmd.add_argument("--revision", help="branch, tag or commit; recorded as the full commit")
    cmd.add_argument("--zip", type=Path, help="also write the zip to register here")
    cmd.add_argument("files", nargs="+", metavar="FILE", help="Parquet files in training order")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        descriptor, problems = describe(args.files, args.tokenizer, args.repository, args.revision)
    except UsageError as err:
        print(f"describe: {err}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem, file=sys.stderr)
    if descriptor is None:
        return 1
    if args.zip is not None:
        partial = args.zip.with_name(args.zip.name + ".partial")
        try:
            write_prepared_zip(descriptor, [Path(f) for f in args.files], partial)
            os.replace(partial, args.zip)  # never leave a half-written zip under the name to register
        except OSError as err:
            partial.unlink(missing_ok=True)
            print(f"describe: cannot write {args.zip}: {err.strerror or err}", file=sys.stderr)
            return 2
    print(json.dumps(descriptor.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
