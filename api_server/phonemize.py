"""Text -> espeak-ng IPA clauses, via the espeak-ng build bundled in piper-tts.

Why espeak-ng through piper-tts: the voice was trained on espeak-ng's IPA (config
``phoneme_type: espeak``, voice ``en-us``), so another G2P (MIT rule sets, CMUdict,
neural G2P) would feed the model symbol sequences it never saw and change how words
are spoken; matching piper sample for sample is only possible with the same
phonemizer. piper-tts ships espeak-ng (library + data) as a manylinux wheel, so no
system package is needed. Both are GPL-3.0-or-later, hence this module is only
usable with the optional ``tts`` extra installed, and is imported lazily.

We call ``piper.espeakbridge`` directly (not ``PiperVoice.phonemize``) because
streaming needs espeak's clause boundaries, which piper's API merges into sentences.
Each clause is turned into symbols exactly as piper.phonemize_espeak does, so whole
sentences give piper's phonemes.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from dataclasses import dataclass
from types import ModuleType

from pipelines.checkpoint.voice_config import INSTALL_HINT

# espeak marks words read in another language as "(fr)...(en)"; piper drops the flags.
_LANGUAGE_FLAG = re.compile(r"\([^)]+\)")
# After these terminators the sentence goes on, so piper keeps a word gap.
_CLAUSE_CONTINUES = (",", ":", ";")

# espeak-ng keeps global C state (voice, buffers): one caller at a time.
_LOCK = threading.Lock()
_bridge: ModuleType | None = None


@dataclass(frozen=True)
class Clause:
    """One espeak clause as model symbols (NFD code points, terminator included)."""

    symbols: tuple[str, ...]
    end_of_sentence: bool


def phonemize(text: str, espeak_voice: str) -> list[Clause]:
    """Clauses of ``text`` in order; sentence ends are espeak's own decisions."""
    with _LOCK:
        bridge = _espeak()
        bridge.set_voice(espeak_voice)
        raw = bridge.get_phonemes(text)
    return [Clause(_symbols(ipa, terminator), end) for ipa, terminator, end in raw]


def _symbols(ipa: str, terminator: str) -> tuple[str, ...]:
    # Same steps as piper.phonemize_espeak.EspeakPhonemizer.phonemize: punctuation is
    # kept as a symbol (it shapes prosody), and NFD splits accents into their own ids.
    text = _LANGUAGE_FLAG.sub("", ipa) + terminator
    if terminator in _CLAUSE_CONTINUES:
        text += " "
    return tuple(unicodedata.normalize("NFD", text))


def _espeak() -> ModuleType:
    """piper's espeak-ng binding, initialized once with piper's bundled data."""
    global _bridge
    if _bridge is None:
        try:
            from piper import espeakbridge
            from piper.phonemize_espeak import ESPEAK_DATA_DIR
        except ImportError as error:
            raise ImportError(INSTALL_HINT) from error
        espeakbridge.initialize(str(ESPEAK_DATA_DIR))
        _bridge = espeakbridge
    return _bridge
