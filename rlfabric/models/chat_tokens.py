"""Token-in/token-out turns through a tokenizer's chat template.

A multi-turn episode's token sequence is built by appending, never by re-tokenizing the conversation: the first
prompt is the chat template applied to the opening messages; after that, each turn appends the generator's sampled
ids exactly as sampled, then the tokens of the env's reply wrapped in the template's delimiters. Re-tokenizing
the whole chat each turn can split the sampled text differently from how it was sampled, so the learner would
score tokens the policy never produced.

The delimiters are read off the template once, by rendering a probe conversation with marker strings and cutting
at the markers: what closes an assistant turn (e.g. ``<|im_end|>\\n``), what opens and closes a user turn, and the
generation prompt that opens the next assistant turn. When the sample already ends with the token that closes the
turn (the model stopped on it), only the rest of the closing text is added.

Text the tokenizer cannot spell (a character the builtin character tokenizer has no token for: it has no unknown
token) raises ``UnspellableText`` naming the characters, instead of the tokenizer's own error; a character counts
as unspellable only when encoding it fails or does not decode back to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
_USER, _ASSISTANT, _NEXT = "\x01USER\x01", "\x01ASSISTANT\x01", "\x01NEXT\x01"


class UnspellableText(ValueError):
    """Text with characters the tokenizer has no token for. The builtin model's character tokenizer spells only
    ``model.builtin.alphabet`` and has no unknown token, so its own error ("Missing [UNK] token") names neither the
    characters nor the setting; this does. ``characters``: the ones it lacks, in order of first use."""

    def __init__(self, characters: str, text: str) -> None:
        self.characters, self.text = characters, text
        # the message leaves the text out: the same characters in many tasks are one error, printed once
        super().__init__(
            f"the tokenizer has no token for {', '.join(map(repr, characters))}; the builtin model spells only the "
            "characters of model.builtin.alphabet ('tool' adds {}[]\"'_\\ for JSON tool calls)"
        )


def unspellable(tokenizer: Any, text: str) -> str:
    """The characters of ``text`` that ``tokenizer`` cannot spell: those whose encoding fails or does not decode
    back to the character (an unknown token). Not a vocabulary lookup: a byte-level BPE vocabulary holds a space
    as ``Ġ``, and a subword one may hold a character only inside longer tokens, yet both spell it."""
    return "".join(c for c in dict.fromkeys(text) if not _spells(tokenizer, c))


def _spells(tokenizer: Any, character: str) -> bool:
    try:
        ids = tokenizer(character, add_special_tokens=False).input_ids
        back = tokenizer.decode(ids)
    except Exception:  # the builtin character tokenizer has no unknown token: it fails on a character it lacks
        return False
    # some tokenizers add or drop a space around a lone character (SentencePiece's "▁"), or a lone space itself
    return back.strip() == character.strip() and (bool(ids) or character.isspace())


def spelled(tokenizer: Any, text: str, encode: Callable[[], T]) -> T:
    """``encode()``, which tokenizes ``text`` (alone or inside a template): a failure on characters of ``text``
    that ``tokenizer`` cannot spell (``unspellable``) is raised as ``UnspellableText``, any other as the tokenizer's
    own error."""
    try:
        return encode()
    except Exception:
        missing = unspellable(tokenizer, text)
        if not missing:
            raise  # some other failure (no chat template, a template error): the tokenizer's own error
        raise UnspellableText(missing, text) from None


class ChatTokens:
    """The token pieces of a multi-turn chat for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, role: str = "user") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat template: multi-turn envs format turns through one "
                "(set tokenizer.chat_template, or use a model whose tokenizer ships one)"
            )
        self.tokenizer = tokenizer
        self.role = role
        first = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        before = self.render(first, generation_prompt=False)
        after = self.render([*first, {"role": role, "content": _NEXT}], generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(
                "the tokenizer's chat template renders earlier turns differently once a turn is added, so turns "
                "cannot be appended token by token; multi-turn envs need an append-only template"
            )
        closing = before[before.index(_ASSISTANT) + len(_ASSISTANT) :]
        opening, reply_end = after[len(before) :].split(_NEXT)
        self.turn_close = self._ids(closing)  # after the assistant's text: e.g. <|im_end|> and a newline
        self.reply_open = self._ids(opening)  # e.g. <|im_start|>user\n
        self.reply_close = self._ids(reply_end)  # e.g. <|im_end|>\n<|im_start|>assistant\n

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool, tools: Any = None) -> str:
        """``messages`` (and ``tools``, the tool definitions, when the template shows them) through the template,
        as text; with ``generation_prompt``, the opening of the next assistant turn after them."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _ids(self, text: str) -> list[int]:
        if not text:
            return []
        return spelled(self.tokenizer, text, lambda: list(self.tokenizer(text, add_special_tokens=False).input_ids))

    def text_ids(self, text: str) -> list[int]:
        """``text`` alone as token ids (no special tokens added): a scripted turn's action."""
        return self._ids(text)

    def prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The first prompt: the opening messages through the template, with the generation prompt."""
        return self._ids(self.render(list(messages), generation_prompt=True))

    def close_after(self, sampled: Sequence[int]) -> list[int]:
        """What closes an assistant turn whose ids are ``sampled``: the template's closing delimiter, less its first
        token when the model sampled that itself (it stopped on it)."""
        close = self.turn_close
        if close and sampled and sampled[-1] == close[0]:
            return close[1:]
        return list(close)

    def reply(self, sampled: Sequence[int], text: str) -> list[int]:
        """The tokens to append after a turn's ``sampled`` ids: the rest of the turn's closing delimiter, then
        the env's reply ``text`` as a ``role`` message, then the next assistant turn's opening."""
        return [*self.close_after(sampled), *self.reply_open, *self._ids(text), *self.reply_close]
