"""Text of a choice as its tokens arrive, decoding only the new ones, and stop strings cut out of it.

`IncrementalText` decodes a short window (the tokens since the last emitted boundary, plus the new
ones) instead of the whole completion on every streamed event (which made a long answer quadratic on
the host). A window starts a few tokens back because a token's text can depend on its neighbours
(SentencePiece's leading-space marker, byte-level BPE pieces of one multi-byte character): the text
added by the new tokens is decode(window) minus decode(window without them). A window whose text
ends in U+FFFD is half a multi-byte character: nothing is emitted until the rest arrives (`finish`
emits whatever is left, as the full decode would).

`StopCut` holds back the tail of the text that could still become a stop string (the longest suffix
that is a prefix of one), so no stop string is ever sent, and cuts the text where one starts."""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = 0  # the window's first token
        self.read = 0  # tokens whose text has been emitted

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add(self, tokens: list[int]) -> str:
        """The text `tokens[read:]` adds (`tokens`: every token of the choice so far); '' while it ends in
        half a character."""
        if len(tokens) <= self.read:
            return ""
        before = self._decode(tokens[self.prefix:self.read])
        window = self._decode(tokens[self.prefix:])
        if window.endswith(_REPLACEMENT) or len(window) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(tokens)
        return window[len(before):]

    def finish(self, tokens: list[int]) -> str:
        """The rest at the end of the choice, an incomplete character included (the full decode's U+FFFD)."""
        before = self._decode(tokens[self.prefix:self.read])
        window = self._decode(tokens[self.prefix:])
        self.prefix = self.read = len(tokens)
        return window[len(before):]


class StopCut:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # text decoded but not sent: it could start a stop string
        self.stopped = False

    def feed(self, text: str, final: bool = False) -> str:
        """What of `held + text` can be sent now. After a stop string is found (`stopped`), nothing more."""
        if self.stopped:
            return ""
        window = self.held + text
        found = [window.find(s) for s in self.stops if s in window]
        if found:
            self.stopped, self.held = True, ""
            return window[:min(found)]
        if final:
            self.held = ""
            return window
        keep = self._open_tail(window)
        self.held = window[len(window) - keep:] if keep else ""
        return window[:len(window) - keep]

    def _open_tail(self, window: str) -> int:
        """Length of the longest suffix of `window` that is a proper prefix of some stop string."""
        for size in range(min(len(window), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = window[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
