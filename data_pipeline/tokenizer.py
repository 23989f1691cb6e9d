"""Load an HF tokenizer for training, make primitive tokens single tokens, fingerprint it.

Fingerprints follow seed 003 ("The descriptor"): `tokenizerSha256` is the SHA-256 of
`tokenizer.backend_tokenizer.to_str()`, `chatTemplateSha256` the SHA-256 of the chat
template text. Shards and checkpoints record both; a mismatch is an error downstream.

When the training template replaces the checkpoint's own (an inference template without generation
markers, as every hub checkpoint ships), the replaced one stays readable (`checkpoint_chat_template`): an
export gives it back as the default template HF and vLLM serve with. It is no part of the fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from data_pipeline import vocabulary
from data_pipeline.chat_templates import END_OF_TURN, FAMILY_TOKENS, TRAINING_TEMPLATES
from data_pipeline.chat_templates import template_family as family_of_template

log = logging.getLogger(__name__)

GENERATION_MARKER = "{% generation %}"
# Where `ensure_training_template` keeps the template(s) it replaced on the tokenizer object (not saved with it).
_REPLACED = "_valen_checkpoint_chat_template"


class TokenizerError(ValueError):
    """A tokenizer that cannot train on our formats (missing template markers, wrong tokens)."""


@dataclass(frozen=True)
class TokenizerFingerprint:
    tokenizer_sha256: str
    chat_template_sha256: str

    def to_json(self) -> dict[str, str]:
        return {"tokenizerSha256": self.tokenizer_sha256, "chatTemplateSha256": self.chat_template_sha256}

    @classmethod
    def from_json(cls, data: dict[str, str]) -> TokenizerFingerprint:
        return cls(data["tokenizerSha256"], data["chatTemplateSha256"])


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint(tokenizer: PreTrainedTokenizerBase) -> TokenizerFingerprint:
    template = tokenizer.chat_template
    if not isinstance(template, str):
        raise TokenizerError("tokenizer has no single chat template to fingerprint")
    return TokenizerFingerprint(
        tokenizer_sha256=sha256_text(tokenizer.backend_tokenizer.to_str()),
        chat_template_sha256=sha256_text(template),
    )


def has_generation_markers(template: str | dict | None) -> bool:
    # A dict holds a checkpoint's named templates (transformers' additional_chat_templates): none is chosen.
    return isinstance(template, str) and "generation" in template and "endgeneration" in template


def add_primitive_tokens(tokenizer: PreTrainedTokenizerBase) -> int:
    """Add every number token, primitive tag and vision token that is not one token yet.

    Returns how many were added; the caller reports it (new embedding rows follow).
    """
    wanted = [*vocabulary.NUMBER_TOKENS, *vocabulary.PRIMITIVE_TAGS]
    vocab = tokenizer.get_vocab()
    missing = [t for t in wanted if t not in vocab]
    # normalized=False: a number token must match its literal text, never a lowercased form.
    added = tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in missing])
    missing_vision = [t for t in vocabulary.VISION_TOKENS if t not in vocab]
    added += tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, normalized=False, special=True) for t in missing_vision]},
        replace_extra_special_tokens=False,
    ) if missing_vision else 0
    for token in [*wanted, *vocabulary.VISION_TOKENS]:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise TokenizerError(f"{token!r} encodes to {len(ids)} tokens, expected exactly one")
    return added


# `template_family="auto"` (config.data.template_family's default): the family the tokenizer's own template
# writes, so a Llama 3.x checkpoint trains with the llama3 template and a Qwen one with ChatML, without a key.
AUTO_FAMILY = "auto"


def infer_template_family(tokenizer: PreTrainedTokenizerBase) -> str:
    """The training template family of a hub tokenizer: the one whose end-of-turn token its own chat template
    writes, else the one whose control tokens its vocabulary alone holds; refused when neither tells."""
    vocab = tokenizer.get_vocab()
    usable = [family for family, tokens in FAMILY_TOKENS.items() if all(t in vocab for t in tokens)]
    written = family_of_template(tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None)
    if written in usable:
        return written
    if written is None and len(usable) == 1:
        return usable[0]
    raise TokenizerError(
        "cannot tell which training template fits this tokenizer (its chat template writes "
        f"{'no known end-of-turn token' if written is None else repr(END_OF_TURN[written]) + ', which its vocabulary lacks'}"
        f"; families whose control tokens it holds: {', '.join(usable) or 'none'}): set the template family "
        f"({', '.join(TRAINING_TEMPLATES)}; config.data.template_family, convert's --template-family)")


def ensure_training_template(tokenizer: PreTrainedTokenizerBase, family: str | None = None) -> None:
    """Keep a template that marks assistant spans, or install the shipped one for `family` ("auto": the
    family `infer_template_family` reads from the tokenizer).

    An unknown family is refused even when the template has markers, so a typo never passes
    unnoticed; installing a family's template needs that family's control tokens as single tokens
    (otherwise they would be tokenised as text and no end-of-turn token would be trained).
    """
    if family is not None and family != AUTO_FAMILY and family not in TRAINING_TEMPLATES:
        raise TokenizerError(f"unknown chat template family {family!r}; known: "
                             f"{', '.join([AUTO_FAMILY, *TRAINING_TEMPLATES])}")
    if has_generation_markers(tokenizer.chat_template):
        return
    if family is None:
        raise TokenizerError(
            "the tokenizer's chat template has no {% generation %} markers, so assistant masks would be "
            f"all zero; pass a template family ({', '.join([AUTO_FAMILY, *TRAINING_TEMPLATES])}) to use a "
            "shipped one"
        )
    if family == AUTO_FAMILY:
        family = infer_template_family(tokenizer)
    vocab = tokenizer.get_vocab()
    missing = [t for t in FAMILY_TOKENS[family] if t not in vocab]
    if missing:
        raise TokenizerError(f"the {family} template writes {', '.join(missing)}, which this tokenizer lacks; "
                             "pick the family the model was trained with")
    setattr(tokenizer, _REPLACED, tokenizer.chat_template)
    tokenizer.chat_template = TRAINING_TEMPLATES[family]


def installed_template_family(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The family whose training template `ensure_training_template` installed; None where it kept the
    tokenizer's own (a marked template)."""
    return family_of_template(tokenizer.chat_template) if hasattr(tokenizer, _REPLACED) else None


def checkpoint_chat_template(tokenizer: PreTrainedTokenizerBase) -> str | dict | None:
    """The chat template(s) the tokenizer was loaded with, where `ensure_training_template` replaced them
    (a text, a dict of named templates, or None when it had none); None too when nothing was replaced."""
    return getattr(tokenizer, _REPLACED, None)


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token that ends an assistant turn under the tokenizer's template (see chat_templates).

    A family template's own end-of-turn (Llama-3: `<|eot_id|>`, not the eos token); for a user's
    template of no known family, the eos token.
    """
    family = family_of_template(tokenizer.chat_template)
    token = END_OF_TURN[family] if family is not None else tokenizer.eos_token
    if token is None:
        raise TokenizerError("the chat template is of no known family and the tokenizer has no eos token, "
                             "so no end-of-turn token can be checked")
    return token_id(tokenizer, token)


def from_pretrained(path_or_name: str | Path) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained`, with one line naming the path when it is neither a directory nor a
    hub name that resolves (transformers' own answer is a page of hub traceback, or for a local-looking
    path a complaint about repo id syntax)."""
    text = str(path_or_name)
    path = Path(text).expanduser()
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    if path.exists():
        raise TokenizerError(f"{text!r}: not a directory (a tokenizer is a directory of HF tokenizer files)")
    # A hub name is `name` or `namespace/name`: anything else can only have meant a local directory.
    if Path(text).is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 or "\\" in text:
        raise TokenizerError(f"{text!r}: no such directory")
    try:
        return AutoTokenizer.from_pretrained(text)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise TokenizerError(f"{text!r}: no such directory, and not a hub name in the cache ({reason})") from None


def load_tokenizer(path_or_name: str | Path, template_family: str | None = None) -> PreTrainedTokenizerBase:
    """Load any HF tokenizer, ready for training: primitive tokens and a marked template."""
    tokenizer = from_pretrained(path_or_name)
    if not tokenizer.is_fast:
        raise TokenizerError(f"{path_or_name}: a fast tokenizer is required (offsets and backend fingerprint)")
    added = add_primitive_tokens(tokenizer)
    if added:
        log.warning("%s: added %d primitive/vision tokens missing from the tokenizer", path_or_name, added)
    ensure_training_template(tokenizer, template_family)
    return tokenizer


def filler_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that fills a row's positions past its examples: the pad token, else the eos token (Llama 3.x
    tokenizers ship no pad token). Which id it is does not reach a result: every loss reads an explicit weight
    array and attention masks by segment id (DESIGN, "Contracts"), so filler positions are never seen."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    raise TokenizerError("the tokenizer has neither a pad nor an eos token: rows cannot be filled")


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    ids = tokenizer.convert_tokens_to_ids([token])
    if ids[0] is None or ids[0] == tokenizer.unk_token_id:
        raise TokenizerError(f"tokenizer lacks {token!r}")
    return int(ids[0])


def number_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return [token_id(tokenizer, t) for t in vocabulary.NUMBER_TOKENS]
