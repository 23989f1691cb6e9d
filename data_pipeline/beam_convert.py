"""The conversion of `data_pipeline.conversion` as an Apache Beam pipeline (optional extra `beam`).

    pip install 'valen-jax[beam]'
    python -m data_pipeline.convert --runner=beam --format=recipe --input=data/smoke/vflash/recipe.json \
        --output=/tmp/vflash_shards --tokenizer=data/tokenizer
    # on a cluster: --beam-runner=DataflowRunner|FlinkRunner|SparkRunner --beam-option KEY=VALUE ...

The output is the local runner's, byte for byte (shards and manifest.json): both start from
`conversion.prepare` and end in `conversion.write_output`; only the rendering in between differs.

1. The launcher runs `conversion.prepare`: option checks, the format's `load` (records are small
   picklable dataclasses) and its `check`.
2. `beam.Create` of (global index, (record, entry name)); a `DoFn` whose `setup()` loads the tokenizer
   and builds the format's renderer once per worker renders each record to Example bytes. A record
   the renderer refuses (RenderError, FormatError, any ValueError) becomes an error entry rather than
   a failed bundle, so the launcher reports it exactly as the local runner does: the first bad
   record in input order, same type and message (Beam would wrap it, and RenderError does not pickle).
3. Workers write (index, bytes) with `fileio.WriteToFiles` (temporary files, moved into place when
   their bundle commits, so a retried bundle never shows twice) into a gather directory:
   `<temp_location>/valen-convert-<uuid>` when `--beam-option temp_location=...` is given, else a
   temporary directory beside `--output`.
4. After the pipeline, the launcher reads the gather files back, orders them by index, checks that
   every record came back exactly once, and writes shards + manifest with `conversion.write_output`
   (staged beside `--output`, then renamed), then deletes the gather directory.

On a cluster (Dataflow, Flink, Spark) the same code runs, with these requirements:

- workers must read what the records point at: the input's media files and `--tokenizer` (a hub
  name, or a path inside the worker image / a shared mount), since rendering hashes and copies media;
- the gather directory must be storage both workers and launcher see (`--beam-option
  temp_location=gs://bucket/tmp`; Beam's FileSystems handles gs://, s3://, hdfs://), and the launcher
  needs the runner's filesystem extra (e.g. `apache-beam[gcp]` for gs://, not part of our `beam` extra);
- workers need this package: build a wheel (`pip wheel --no-deps -w dist .`) and pass
  `--beam-option extra_package=dist/valen_jax-0.1.0-py3-none-any.whl`, or use a worker image
  (`--beam-option sdk_container_image=...`).

The launcher holds every rendered Example in memory once, as the local runner does; `--output`
is a local directory. For data that outgrows one launcher, the next step keeps this module's
shape: workers group records by their shard (contiguous index ranges fixed by the record count,
see `shards.write_shards`) and write the ArrayRecord shards themselves, and the launcher only
combines per-shard statistics into the manifest.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from data_pipeline import format_registry as registry
from data_pipeline import shards
from data_pipeline.conversion import BEAM_RUNNERS, prepare, write_output
from data_pipeline.formats.errors import FormatError, Problem
from data_pipeline.render.common import RenderError
from data_pipeline.tokenizer import load_tokenizer

# Without the gcp extra, apache_beam's BigQuery stub calls `logging.warning` at import, which would
# configure the root logger (basicConfig) behind the application's back and print a line about a
# library we do not use. A NullHandler held on the root logger during the import leaves it as found.
_import_guard = logging.NullHandler()
logging.getLogger().addHandler(_import_guard)
try:
    import apache_beam as beam
    from apache_beam.io import fileio
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions
finally:
    logging.getLogger().removeHandler(_import_guard)

log = logging.getLogger(__name__)

# Beam's DirectRunner (>= 2.6x) first tries the Prism runner, downloading its binary from GitHub,
# and falls back to the in-process FnApiRunner. `DirectRunner` here goes straight to FnApiRunner:
# no network, the same run on every machine; direct_running_mode / direct_num_workers still apply.
_DIRECT_RUNNER = "FnApiRunner"
# DirectRunner here: one in-process worker unless the caller asks for more.
_DIRECT_DEFAULTS = {"direct_running_mode": "in_memory", "direct_num_workers": "1"}
_GATHER_PREFIX = "rendered"
_RECORD_HEADER = struct.Struct("<QBI")  # global index, kind, payload length
_EXAMPLE, _ERROR = 0, 1  # kinds: Example bytes; the JSON of `_error_payload`


class RenderFn(beam.DoFn):
    """(index, (record, entry name)) -> (index, Example bytes); the renderer is built once per worker."""

    def __init__(self, fmt: str, tokenizer: str, template_family: str | None,
                 render_options: Mapping[str, object]):
        self._fmt = fmt
        self._tokenizer = tokenizer
        self._template_family = template_family
        self._render_options = dict(render_options)
        self._renderer = None

    def setup(self):
        logging.getLogger("data_pipeline.tokenizer").setLevel(logging.ERROR)
        tok = load_tokenizer(self._tokenizer, self._template_family)
        self._renderer = registry.get(self._fmt).make_renderer(tok, **self._render_options)

    def process(self, element):
        index, (record, entry) = element
        try:
            yield index, _EXAMPLE, self._renderer.render(record, entry).to_bytes()
        except ValueError as err:  # RenderError, FormatError, ...: the record's fault, reported by the launcher
            yield index, _ERROR, json.dumps(_error_payload(err)).encode("utf-8")


def _error_payload(err: ValueError) -> dict:
    if isinstance(err, RenderError):
        return {"type": "RenderError", "args": [err.source, err.line, err.field, err.message]}
    if isinstance(err, FormatError):
        return {"type": "FormatError", "problems": [p.to_json() for p in err.problems]}
    return {"type": type(err).__name__, "message": str(err)}


def _error_from_payload(payload: dict) -> ValueError:
    if payload["type"] == "RenderError":
        return RenderError(*payload["args"])
    if payload["type"] == "FormatError":
        return FormatError([Problem(**p) for p in payload["problems"]])
    return ValueError(payload["message"])


class IndexedBytesSink(fileio.FileSink):
    """Writes (index, kind, payload) as `u64 index | u8 kind | u32 length | payload`, little-endian."""

    def open(self, fh):
        self._fh = fh

    def write(self, record):
        index, kind, data = record
        self._fh.write(_RECORD_HEADER.pack(index, kind, len(data)))
        self._fh.write(data)

    def flush(self):
        self._fh.flush()


def _read_gathered(gather_dir: str, count: int) -> list[bytes]:
    """The gathered Example bytes in index order; each of `count` indices exactly once.

    Raises the error of the first refused record in index order, as the local runner would.
    """
    rendered: list[bytes | None] = [None] * count
    errors: dict[int, bytes] = {}
    pattern = FileSystems.join(gather_dir, f"{_GATHER_PREFIX}-*")
    for metadata in FileSystems.match([pattern])[0].metadata_list:
        with FileSystems.open(metadata.path, compression_type="uncompressed") as handle:
            data = handle.read()
        offset = 0
        while offset < len(data):
            index, kind, length = _RECORD_HEADER.unpack_from(data, offset)
            offset += _RECORD_HEADER.size
            example = data[offset:offset + length]
            offset += length
            if len(example) != length or index >= count or kind not in (_EXAMPLE, _ERROR):
                raise ValueError(f"{metadata.path}: truncated or out-of-range record (index {index})")
            if kind == _ERROR:
                errors[index] = example
                continue
            if rendered[index] is not None and rendered[index] != example:
                raise ValueError(f"record {index} came back twice with different bytes")
            rendered[index] = example
    if errors:
        raise _error_from_payload(json.loads(errors[min(errors)]))
    missing = [i for i, data in enumerate(rendered) if data is None]
    if missing:
        raise ValueError(f"{len(missing)} of {count} records did not come back from the pipeline "
                         f"(first: {missing[:5]})")
    return rendered  # type: ignore[return-value]


def pipeline_options(beam_runner: str = "DirectRunner",
                     beam_options: Mapping[str, str | None] | None = None) -> PipelineOptions:
    """`--runner=<beam_runner>` plus `--KEY=VALUE` per option (`--KEY` where the value is None, for
    switches such as save_main_session); DirectRunner defaults to one in-memory worker."""
    if beam_runner not in BEAM_RUNNERS:
        raise ValueError(f"--beam-runner={beam_runner}: choose one of {', '.join(BEAM_RUNNERS)}")
    given = dict(beam_options or {})
    if "runner" in given:
        raise ValueError("--beam-option runner=...: use --beam-runner")
    runner = beam_runner
    if beam_runner == "DirectRunner":
        runner, given = _DIRECT_RUNNER, {**_DIRECT_DEFAULTS, **given}
    flags = [f"--{k}" if v is None else f"--{k}={v}" for k, v in given.items()]
    return PipelineOptions([f"--runner={runner}", *flags])


def convert_beam(fmt: str, input_path: str | Path, output: str | Path, tokenizer: str | Path,
                 overwrite: bool = False, options: Mapping[str, object] | None = None,
                 template_family: str | None = None, beam_runner: str = "DirectRunner",
                 beam_options: Mapping[str, str | None] | None = None) -> shards.Manifest:
    """`conversion.convert` with rendering on Beam; same arguments, same output bytes."""
    pipeline_opts = pipeline_options(beam_runner, beam_options)  # bad runner options fail before loading
    conv = prepare(fmt, input_path, output, tokenizer, overwrite, options, template_family)
    temp_location = pipeline_opts.get_all_options().get("temp_location")
    if temp_location:
        gather_dir, local_gather = FileSystems.join(temp_location, f"valen-convert-{uuid.uuid4().hex}"), None
    else:
        if beam_runner != "DirectRunner":
            log.warning("%s without --beam-option temp_location=...: workers write into a local temporary "
                        "directory the launcher must be able to read", beam_runner)
        conv.output.parent.mkdir(parents=True, exist_ok=True)
        local_gather = tempfile.mkdtemp(prefix=f".{conv.output.name}.beam.", dir=conv.output.parent)
        gather_dir = local_gather
    try:
        render = RenderFn(fmt, str(tokenizer), template_family, conv.render_options)
        with beam.Pipeline(options=pipeline_opts) as pipeline:
            _ = (pipeline
                 | "Records" >> beam.Create(list(enumerate(conv.jobs)))
                 | "Render" >> beam.ParDo(render)
                 | "Gather" >> fileio.WriteToFiles(
                     gather_dir, sink=IndexedBytesSink,
                     file_naming=fileio.default_file_naming(_GATHER_PREFIX, ".bin")))
        rendered = _read_gathered(gather_dir, len(conv.jobs))
    finally:
        if local_gather is not None:
            shutil.rmtree(local_gather, ignore_errors=True)
        else:
            try:
                FileSystems.delete([gather_dir])
            except Exception as err:  # cleanup only; the conversion result stands
                log.warning("%s: could not delete the gather directory: %s", gather_dir, err)
    return write_output(conv, rendered)


def parse_beam_options(pairs: Sequence[str] | None) -> dict[str, str | None]:
    """`KEY=VALUE` strings (from repeated `--beam-option`) into a mapping; a bare KEY is a switch (None)."""
    result = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip().lstrip("-")
        if not key:
            raise ValueError(f"--beam-option {pair!r}: expected KEY=VALUE")
        result[key] = value if sep else None
    return result
