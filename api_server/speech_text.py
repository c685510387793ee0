"""Text -> short, speakable segments with the voice's phoneme ids, for streaming.

Pipeline: normalise (control characters, whitespace; blank lines end paragraphs)
-> espeak-ng clauses per paragraph -> sentences (espeak decides where they end, as
in piper) -> segments. Each segment is one model run.

Segmenting rules, chosen so the first audio comes quickly without hurting prosody:
* A sentence is normally one segment: then its phoneme ids, and so its audio, are
  exactly piper's.
* The first segment is at most FIRST_SEGMENT_MAX_SYMBOLS symbols (about 4 s of
  speech, ~0.3 s to synthesize on 1 core): a longer first sentence is cut after its
  last clause (comma, semicolon...) that fits, else at a word boundary.
* Later segments are at most SEGMENT_MAX_SYMBOLS symbols (about 20 s of speech),
  cut the same way, which bounds latency between segments and the model's memory
  (its text encoder's attention is quadratic in length).
* Short sentences are not merged: that would change piper's audio; a caller wanting
  fewer runs can batch them (OnnxVoice.synthesize_batch).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from api_server.phonemize import phonemize
from pipelines.checkpoint.voice_config import BOS, EOS, PAD, VoiceConfig, default_voice_config

# OpenAI's /v1/audio/speech limit on ``input``.
MAX_INPUT_CHARS = 4096
FIRST_SEGMENT_MAX_SYMBOLS = 80
SEGMENT_MAX_SYMBOLS = 400

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_WHITESPACE = re.compile(r"\s+")
_WORD_GAP = " "

Symbols = tuple[str, ...]


@dataclass(frozen=True)
class Segment:
    """One unit of synthesis: its IPA (for logs/debugging) and the model's input."""

    phonemes: str
    phoneme_ids: list[int]


def text_to_segments(text: str, config: VoiceConfig | None = None) -> list[Segment]:
    """Split ``text`` into segments to synthesize in order (for the default voice unless
    ``config`` names another); the first one is short.

    Raises ValueError for text that is empty, too long, or has nothing to speak.
    """
    config = config or default_voice_config()
    pieces: list[Symbols] = []
    for paragraph in normalize_text(text):
        for sentence in _sentences(paragraph, config.espeak_voice):
            limit = SEGMENT_MAX_SYMBOLS if pieces else FIRST_SEGMENT_MAX_SYMBOLS
            split = _split(sentence, limit, SEGMENT_MAX_SYMBOLS)
            pieces.extend(p for p in split if _speakable(p))
    if not pieces:
        raise ValueError("input text has nothing to speak")
    return [_segment(p, config.phoneme_id_map) for p in pieces]


def normalize_text(text: str) -> list[str]:
    """Paragraphs of ``text`` with whitespace collapsed; ValueError if none."""
    if len(text) > MAX_INPUT_CHARS:
        raise ValueError(f"input text is longer than {MAX_INPUT_CHARS} characters")
    unified = text.replace("\r\n", "\n").translate(_LINE_BREAKS)
    cleaned = "".join(" " if _is_control(ch) else ch for ch in unified)
    paragraphs = [
        _WHITESPACE.sub(" ", p).strip() for p in _PARAGRAPH_BREAK.split(cleaned)
    ]
    paragraphs = [p for p in paragraphs if p]
    if not paragraphs:
        raise ValueError("input text is empty")
    return paragraphs


def phonemes_to_ids(
    symbols: Sequence[str], id_map: Mapping[str, Sequence[int]]
) -> list[int]:
    """Piper's encoding: BOS PAD (id PAD)* EOS; symbols missing from the map are dropped."""
    ids = [*id_map[BOS], *id_map[PAD]]
    for symbol in symbols:
        if symbol in id_map:
            ids.extend(id_map[symbol])
            ids.extend(id_map[PAD])
    ids.extend(id_map[EOS])
    return ids


# \r, and Unicode line/paragraph separators, read as newlines.
_LINE_BREAKS = str.maketrans({"\r": "\n", "\u2028": "\n", "\u2029": "\n\n"})


def _is_control(ch: str) -> bool:
    # Control characters (NUL in particular) must not reach espeak's C API.
    return ch not in "\n\t" and unicodedata.category(ch) == "Cc"


def _sentences(paragraph: str, espeak_voice: str) -> list[list[Symbols]]:
    """Group espeak's clauses into sentences, each a list of clauses."""
    sentences: list[list[Symbols]] = [[]]
    for clause in phonemize(paragraph, espeak_voice):
        sentences[-1].append(clause.symbols)
        if clause.end_of_sentence:
            sentences.append([])
    return [s for s in sentences if s]


def _split(sentence: list[Symbols], first_limit: int, limit: int) -> list[Symbols]:
    """Cut a sentence into pieces: the first <= first_limit, the others <= limit."""
    pieces: list[Symbols] = []
    rest = sentence
    while rest:
        head, rest = _take(rest, limit if pieces else first_limit)
        pieces.append(head)
    return pieces


def _take(clauses: list[Symbols], limit: int) -> tuple[Symbols, list[Symbols]]:
    """The longest run of whole clauses within ``limit``, or part of the first one."""
    count = total = 0
    while count < len(clauses) and total + len(clauses[count]) <= limit:
        total += len(clauses[count])
        count += 1
    if count:
        return sum(clauses[:count], ()), clauses[count:]
    head, tail = _cut_clause(clauses[0], limit)
    return head, ([tail] if tail else []) + clauses[1:]


def _cut_clause(symbols: Symbols, limit: int) -> tuple[Symbols, Symbols]:
    """Split an over-long clause at its last word gap within ``limit``."""
    gaps = [
        i for i in range(1, min(limit, len(symbols) - 1) + 1) if symbols[i] == _WORD_GAP
    ]
    if gaps:
        return symbols[: gaps[-1]], symbols[gaps[-1] + 1 :]
    # One huge "word" (e.g. a long number or letter string): cut anywhere, but not
    # between a letter and its combining accent.
    cut = limit
    while cut > 1 and unicodedata.combining(symbols[cut]):
        cut -= 1
    return symbols[:cut], symbols[cut:]


def _speakable(symbols: Symbols) -> bool:
    # Pieces of only punctuation/spaces (text like "..." or "— —") would be noise.
    return any(ch.isalpha() for ch in symbols)


def _segment(symbols: Symbols, id_map: Mapping[str, Sequence[int]]) -> Segment:
    return Segment(
        phonemes="".join(symbols), phoneme_ids=phonemes_to_ids(symbols, id_map)
    )
