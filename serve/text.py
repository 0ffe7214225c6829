"""A completion's text, decoded as SGLang decodes it.

``output_text``: ``tokenizer.decode(output_ids, skip_special_tokens, spaces_between_special_tokens)``
after SGLang's stop trim (unless ``no_stop_trim``): a completion that stopped at a token id is
decoded without that last token; one that stopped on a string is cut where the string begins.  The
output ids and log-probs are never trimmed: they stay every sampled token, which is what the trainer
scores.

``TextDelta``: the text of a stream as increments whose concatenation is the final ``output_text``.
While a completion runs, text that may still change is held back: a character whose bytes are not
all sampled yet (U+FFFD) and the last ``len(longest stop string) - 1`` characters (they may turn out
to begin a stop string that the final text cuts).
"""
from __future__ import annotations


def decode(tokenizer, ids: list[int], *, skip_special_tokens: bool = True,
           spaces_between_special_tokens: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            spaces_between_special_tokens=spaces_between_special_tokens)


def output_text(tokenizer, tokens: list[int], matched, *, skip_special_tokens: bool = True,
                spaces_between_special_tokens: bool = True, no_stop_trim: bool = False) -> str:
    """The text of a finished completion; ``matched`` what stopped it (a token id, a stop string, None)."""
    ids = tokens
    if not no_stop_trim and isinstance(matched, int) and not isinstance(matched, bool) and ids:
        ids = ids[:-1]
    text = decode(tokenizer, ids, skip_special_tokens=skip_special_tokens,
                  spaces_between_special_tokens=spaces_between_special_tokens)
    if not no_stop_trim and isinstance(matched, str):
        at = text.find(matched)
        if at != -1:
            text = text[:at]
    return text


class TextDelta:
    """The new text of one streamed completion at each chunk (see the module docstring).  While it runs,
    the text is decoded incrementally, as vLLM and SGLang do: only the tokens since the last complete
    piece of text, against the same window without the newest tokens, so a chunk costs its own tokens,
    not the whole completion's: a 2048-token stream took 1.06 s of CPU decoded whole at every token, 24 ms so
    (the tests' word-level tokenizer)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, no_stop_trim: bool = False):
        self.tokenizer = tokenizer
        self.opts = {"skip_special_tokens": skip_special_tokens,
                     "spaces_between_special_tokens": spaces_between_special_tokens}
        self.no_stop_trim = no_stop_trim
        self.hold = max((len(s) for s in stop), default=1) - 1 if not no_stop_trim else 0
        self.text = ""  # decoded so far (complete characters only)
        self.prefix = self.read = 0  # the window [prefix, read) whose text is the tail of self.text
        self.sent = ""

    def running(self, tokens: list[int]) -> str:
        before = decode(self.tokenizer, tokens[self.prefix:self.read], **self.opts)
        after = decode(self.tokenizer, tokens[self.prefix:], **self.opts)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(tokens)
        return self._advance(self.text[:max(len(self.text) - self.hold, 0)])

    def final(self, tokens: list[int], matched) -> str:
        return self._advance(output_text(self.tokenizer, tokens, matched, no_stop_trim=self.no_stop_trim,
                                         **self.opts))

    def _advance(self, text: str) -> str:
        # text extends what was sent, but for a decoder that rewrites text across tokens (a cleanup
        # rule): then only what lies past the sent length goes out, and the two can differ.
        new = text[len(self.sent):]
        self.sent += new
        return new
