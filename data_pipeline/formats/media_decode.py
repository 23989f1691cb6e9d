"""The one image decoder: what the training loader runs on media bytes, run first at validate and convert.

Issue 54: a file named `.png` that is not an image passed `validate` and `convert` and stopped training
at its first batch, after compiling. The loader (`valen_jax.data.media`) and the server decode with
`decode_image` below; the format readers call `image_problem` on every image file they check, so
what the loader would refuse is refused while the data is validated, as one `PATH:LINE: field:
message` problem naming the file.

Decoding is the cost, so it runs once per distinct content (sha256) in a process, however many
records, entries or files name the same image. Videos are not decoded here: they are read by PyAV in
the loader, frame by frame.
"""

from __future__ import annotations

import hashlib
import io
import os
import re

from PIL import Image

from data_pipeline.formats.limits import MAX_MEDIA_BYTES, read_file_capped

# Distinct digests remembered; bounded so a huge dataset keeps bounded memory (forgetting only decodes again).
_CACHE_LIMIT = 1 << 16
_decoded: dict[str, str | None] = {}  # sha256 -> why the bytes are not an image, or None


def decode_image(data: bytes) -> Image.Image:
    """The image in `data`, fully decoded: the header (`open`) and every pixel (`load`)."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def _reason(err: Exception) -> str:
    # Pillow names the buffer it read ("cannot identify image file <_io.BytesIO object at 0x…>"):
    # an address says nothing to the user and would make the message differ from run to run.
    text = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(err)).strip()
    return text or type(err).__name__


def bytes_problem(data: bytes, digest: str | None = None) -> str | None:
    """Why the loader could not decode `data` as an image, or None; each content decoded once."""
    digest = digest or hashlib.sha256(data).hexdigest()
    if digest in _decoded:
        return _decoded[digest]
    try:
        decode_image(data).close()
        why = None
    # Whatever Pillow raises on bytes a user supplied (OSError for unknown or truncated files, SyntaxError
    # and ValueError from some plugins, DecompressionBombError) is a problem of that file, not a bug here.
    except Exception as err:  # noqa: BLE001
        why = _reason(err)
    if len(_decoded) >= _CACHE_LIMIT:
        _decoded.clear()
    _decoded[digest] = why
    return why


def image_problem(path: str | os.PathLike, digest: str | None = None) -> str | None:
    """Why the image file at `path` cannot be trained on (unreadable, too large, not decodable), or None.

    `digest`: the file's sha256 when the caller has it, so a content decoded before is not read again.
    The message names the file, so the problem line says which one to fix.
    """
    if digest is None or digest not in _decoded:
        try:
            data = read_file_capped(path, MAX_MEDIA_BYTES)
        except OSError as err:
            return f"cannot read {os.fspath(path)}: {err.strerror or err}"
        digest = hashlib.sha256(data).hexdigest()
        bytes_problem(data, digest)
    why = _decoded.get(digest)
    if why is None:
        return None
    return f"{os.fspath(path)} is not an image Pillow can decode ({why}); the training loader would stop on it"
