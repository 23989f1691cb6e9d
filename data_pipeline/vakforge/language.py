"""Per-turn language id for vakforge turns: the locale pack's `detect_lang` (seed 002, "turns[].lang").

    >>> detect_lang("Haan, mera inverter kal se off hai.", "hi-Latn-IN")
    'hi-Latn'
    >>> detect_lang("Yes, please book it.", "hi-Latn-IN")
    'en-IN'

`prepare` labels each spoken turn after transcription, because ASR language ids are unreliable on
code-switched speech. Two layers:

- lingua (offline n-gram models, no download), restricted to the languages the locale pack declares,
  so "Gracias, perfecto." in an en-US conversation is Spanish and never Portuguese;
- romanised Hindi: lingua's Hindi model knows Devanagari only, so a Latin-script Hinglish turn comes
  out as English. In packs that declare `hi-Latn`, a Latin-script turn is `hi-Latn` when at least
  `HINDI_WORD_SHARE` of its words are romanised Hindi function or common words (`ROMAN_HINDI`).
  Hinglish keeps Hindi grammar (hai, ka, se, kar, hoon) and borrows English nouns and verbs
  ("fault already logged hai"), so the share of Hindi grammar words tells the matrix language; an
  English sentence with one borrowed word ("Thanks yaar, that was quick") stays English.
  Measured on the 21 spoken smoke turns plus the seed's 5: lingua alone labels 16/26 right (every
  hi-Latn turn as English), with the rule 26/26 (tests/test_vakforge_language.py prints and asserts it).

The tag written is the pack's own spelling (an en-US conversation's English is `en-US`, a zh-CN
conversation's English is `en`), as the smoke data and seed 002 write `turns[].lang`.

A turn with no letters ("4821.", a lone placeholder) has no language: `UndeterminedLanguage` is
raised rather than guessing one; its message never repeats the text (it may be personal data).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import cache

# At least this share of a Latin-script turn's words must be romanised Hindi for `hi-Latn`. The seed's
# and smoke set's Hinglish turns sit at 0.43–1.0, their English turns at 0, "Thanks yaar, that was really
# quick." at 0.17.
HINDI_WORD_SHARE = 0.3

# Romanised Hindi grammar and very common words, in the spellings transcripts use. Words that are also
# common English words (to, is, me, main, the, do, hi, are, par, mat, char, din, band) are left out:
# they would pull English turns to Hindi.
ROMAN_HINDI = frozenset("""
    hai hain hoon hun hu ho hoga hogi honge tha thi thhe raha rahi rahe rha rhi
    kar karo karna karni karne karti karta karte karenge karegi karunga karungi kijiye kijie kiya kiye
    diya diye dijiye doon dun dena dedo dijie lo lena liya lijiye lijie
    mera meri mere tera teri tere tumhara tumhari aap aapka aapki aapke apna apni apne
    hum hamara hamari humara mai mujhe mujhko tum tu woh wo yeh ye unka unki uska uski iska iski inka
    kya kyun kyon kyunki kaise kaisa kaisi kab kahan kaun kaunsa kitna kitne kitni kisi koi kuch
    nahi nahin nhi haan haanji han ji theek thik accha acha achha achchha bahut bohot bahot
    aur lekin magar ya phir fir bhi toh sirf zaroor zarur jaldi thoda thodi zyada jyada
    se ka ki ke ko ne mein pe tak wala wali wale liye saath baad pehle wapas
    abhi kal aaj parso subah shaam raat
    ek teen paanch
    namaste namaskar dhanyavaad dhanyavad shukriya
    bol bolo bolna bata batao bataiye bataye sakti sakta sakte madad chahiye chahte chahti chahta
    gaya gayi gaye gya gyi mil mila mili milega milegi jaiye jao jayega jaega jaegi aayega aaya aayi
    chalega chaliye dekh dekhiye dekhte samajh pata kaam ghar wahan yahan idhar udhar
    bhai didi yaar arre bilkul sahi galat matlab agar warna isliye jab tab
""".split())

_PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*_\d+>")  # redaction placeholders carry no language
_LATIN_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")


class UndeterminedLanguage(ValueError):
    """The text has no letters a language could be told from."""


@dataclass(frozen=True)
class LanguageRule:
    """How one locale pack turns lingua's answer into its `turns[].lang` tags."""

    locale: str
    tags: dict[str, str]  # lingua Language name -> the tag this pack writes
    roman_hindi: str | None = None  # the tag of Latin-script Hindi, in packs that declare it


_RULES: dict[str, LanguageRule] = {
    rule.locale: rule
    for rule in (
        LanguageRule("en-US", {"ENGLISH": "en-US", "SPANISH": "es-US"}),
        LanguageRule("en-GB", {"ENGLISH": "en-GB"}),
        LanguageRule("en-IN", {"ENGLISH": "en-IN", "HINDI": "hi"}, roman_hindi="hi-Latn"),
        LanguageRule("hi-Latn-IN", {"ENGLISH": "en-IN", "HINDI": "hi"}, roman_hindi="hi-Latn"),
        LanguageRule("zh-CN", {"CHINESE": "zh-CN", "ENGLISH": "en"}),
    )
}


def language_rule(locale: str) -> LanguageRule:
    """The pack's rule; an unknown locale is an error naming the registered packs."""
    rule = _RULES.get(locale)
    if rule is None:
        raise ValueError(f"locale {locale[:40]!r} has no detect_lang rule; registered packs: {', '.join(_RULES)}")
    return rule


def detect_lang(text: str, locale: str) -> str:
    """The BCP-47 tag of `text` as the `locale` pack writes `turns[].lang` (e.g. "hi-Latn", "en", "zh-CN")."""
    rule = language_rule(locale)
    text = _PLACEHOLDER.sub(" ", text)
    letters = [c for c in text if c.isalpha()]
    if not letters:
        raise UndeterminedLanguage(f"locale {locale}: the text has no letters to identify a language from")
    latin = sum(1 for c in letters if _is_latin(c))
    if rule.roman_hindi is not None and latin * 2 > len(letters):
        words = [w.lower() for w in _LATIN_WORD.findall(text)]
        if words and sum(w in ROMAN_HINDI for w in words) >= HINDI_WORD_SHARE * len(words):
            return rule.roman_hindi
    language = _detector(locale).detect_language_of(text)
    if language is None or language.name not in rule.tags:
        raise UndeterminedLanguage(
            f"locale {locale}: none of the pack's languages ({', '.join(rule.tags.values())}) fits the text"
        )
    return rule.tags[language.name]


def _is_latin(char: str) -> bool:
    return unicodedata.name(char, "").startswith("LATIN")


@cache
def _detector(locale: str):
    """lingua restricted to the pack's languages, built once per locale (models load lazily, offline)."""
    try:
        from lingua import Language, LanguageDetectorBuilder
    except ImportError as err:
        raise ImportError(
            "language detection needs lingua-language-detector: pip install 'valen-jax[vakforge]'"
        ) from err
    languages = [getattr(Language, name) for name in language_rule(locale).tags]
    if len(languages) == 1:
        # lingua needs two languages to choose between; a one-language pack adds one of another script,
        # and a text lingua gives to it is undetermined for this pack (detect_lang raises).
        languages.append(Language.CHINESE if languages[0] is not Language.CHINESE else Language.ENGLISH)
    return LanguageDetectorBuilder.from_languages(*languages).build()
