"""MP3 for /v1/audio/speech (`response_format: mp3`, OpenAI's default): LAME through the
`lameenc` package (the tts extra), encoding each chunk as it comes so the stream stays a
stream. Without the package, mp3 is refused with a 400 naming it."""

from __future__ import annotations

import importlib.util

BIT_RATE_KBPS = 64  # mono speech: transparent enough, a quarter of 16-bit PCM at 24 kHz
QUALITY = 5  # LAME's 2 (best, slowest) .. 7 (fastest); 5 costs ~1% of a core per stream


def mp3_available() -> bool:
    return importlib.util.find_spec("lameenc") is not None


class Mp3Stream:
    """16-bit mono PCM in, MP3 frames out (LAME holds back up to a frame between calls)."""

    def __init__(self, sample_rate: int) -> None:
        import lameenc

        self.encoder = lameenc.Encoder()
        self.encoder.set_bit_rate(BIT_RATE_KBPS)
        self.encoder.set_in_sample_rate(sample_rate)
        self.encoder.set_channels(1)
        self.encoder.set_quality(QUALITY)

    def encode(self, pcm: bytes) -> bytes:
        return bytes(self.encoder.encode(pcm)) if pcm else b""

    def finish(self) -> bytes:
        return bytes(self.encoder.flush())
