"""Run a Piper VITS voice (ONNX) with onnxruntime: phoneme ids in, PCM out.

Output format: float32 mono PCM in [-1.0, 1.0] at ``sample_rate`` (22,050 Hz for
en_US-joe-medium), peak-normalized per call exactly like piper-tts; ``pcm.to_int16``
converts to 16-bit PCM the way piper does.

Batching: the model accepts ``input`` [B, T] + ``input_lengths`` [B], so
``synthesize_batch`` pads several sequences into one session run and cuts each
output to its own length, read from the model's per-phoneme frame counts (exposed
as an extra output, see onnx_graph.py). Measured with noise scales 0 (so that both
paths are deterministic), batched audio equals unbatched audio to within 2e-4
absolute on the raw [-1, 1] model output (padding and different GEMM shapes change
float rounding; a few samples at the very end of the shorter items differ most,
because the HiFi-GAN decoder's convolutions see the batch padding). With the
config's noise scales each run draws fresh Gaussian noise, so batched and unbatched
outputs are different, equally valid renditions. ``synthesize`` is the reference
path; on 2 CPU cores batching gave no throughput gain (see the package docstring).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from pipelines.checkpoint.voice_config import VoiceConfig, load_voice_config

from .onnx_graph import graph_outputs, op_outputs, with_extra_output
from .pcm import peak_normalize

_AUDIO_OUTPUT = "output"


def session_options(intra_op_threads: int, allow_spinning: bool) -> ort.SessionOptions:
    """CPU session options suited to sharing a small machine with other workers."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    # One model, run sequentially: an inter-op pool would only add idle threads.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # ORT's pool threads busy-wait for new work after each op by default; with the cores
    # shared, that steals a core from the PyTorch worker (and from ORT's own next op when
    # there is contention), so spinning is off unless asked for.
    options.add_session_config_entry(
        "session.intra_op.allow_spinning", "1" if allow_spinning else "0"
    )
    return options


def _durations_output(model: bytes) -> str | None:
    """The w_ceil tensor (frames per phoneme) if the graph has exactly one Ceil."""
    ceil_outputs = op_outputs(model, "Ceil")
    if len(ceil_outputs) != 1 or ceil_outputs[0] in graph_outputs(model):
        return None
    return ceil_outputs[0]


class OnnxVoice:
    """One loaded Piper voice: load once (≈2 s, ≈200 MiB resident), then reuse.

    ``session.run`` releases the GIL and may be called from several threads.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        config: VoiceConfig,
        durations_output: str | None = None,
    ) -> None:
        self.session = session
        self.config = config
        self._durations_output = durations_output
        self._input_names = {i.name for i in session.get_inputs()}

    @classmethod
    def load(
        cls,
        model_path: str | Path,
        config_path: str | Path | None = None,
        *,
        intra_op_threads: int = 1,
        allow_spinning: bool = False,
        seed: int | None = None,
    ) -> OnnxVoice:
        """Load the model and its JSON config (default: ``<model>.json``).

        ``seed`` fixes the noise sequence of the new session (``ort.set_seed`` is
        process-wide and read when a session is created): two sessions created after
        the same seed produce the same audio for the same sequence of runs.
        """
        config = load_voice_config(config_path or f"{model_path}.json")
        model = Path(model_path).read_bytes()
        durations = _durations_output(model)
        if durations is not None:
            model = with_extra_output(model, durations)
        if seed is not None:
            ort.set_seed(seed)
        session = ort.InferenceSession(
            model,
            sess_options=session_options(intra_op_threads, allow_spinning),
            providers=["CPUExecutionProvider"],
        )
        return cls(session, config, durations)

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def with_noise(self, noise_scale: float, noise_w: float) -> OnnxVoice:
        """The same session with other noise scales; (0, 0) makes output deterministic."""
        config = replace(self.config, noise_scale=noise_scale, noise_w=noise_w)
        return OnnxVoice(self.session, config, self._durations_output)

    @property
    def supports_batch(self) -> bool:
        """True if batched runs can be cut back to per-item lengths."""
        return self._durations_output is not None

    def synthesize(
        self, phoneme_ids: Sequence[int], speed: float = 1.0, *, normalize: bool = True
    ) -> np.ndarray:
        """Float32 PCM for one phoneme-id sequence (one session run)."""
        _check_ids(phoneme_ids)
        feeds = self._feeds(
            np.asarray([phoneme_ids], dtype=np.int64), [len(phoneme_ids)], speed
        )
        (audio,) = self.session.run([_AUDIO_OUTPUT], feeds)
        return _finish(audio.reshape(-1), normalize)

    def synthesize_batch(
        self,
        batch: Sequence[Sequence[int]],
        speed: float = 1.0,
        *,
        normalize: bool = True,
    ) -> list[np.ndarray]:
        """Float32 PCM per sequence, from a single padded session run.

        Falls back to one run per sequence if the model's lengths are not exposed.
        """
        for phoneme_ids in batch:
            _check_ids(phoneme_ids)
        if not batch:
            return []
        if not self.supports_batch:
            return [self.synthesize(ids, speed, normalize=normalize) for ids in batch]
        lengths = [len(ids) for ids in batch]
        feeds = self._feeds(_pad(batch, self.config.pad_id), lengths, speed)
        audio, frames = self.session.run([_AUDIO_OUTPUT, self._durations_output], feeds)
        return self._cut(audio.reshape(len(batch), -1), frames, normalize)

    def _cut(
        self, audio: np.ndarray, frames: np.ndarray, normalize: bool
    ) -> list[np.ndarray]:
        # w_ceil is already zero on padded phonemes, so each row's sum is its own
        # frame count; the decoder emits hop_length samples per frame.
        samples = frames.reshape(len(audio), -1).sum(axis=1).astype(np.int64)
        samples = np.maximum(samples, 1) * self.config.hop_length
        if int(samples.max()) != audio.shape[1]:
            raise RuntimeError("model durations do not match its audio length")
        return [_finish(row[:n], normalize) for row, n in zip(audio, samples)]

    def _feeds(
        self, ids: np.ndarray, lengths: list[int], speed: float
    ) -> dict[str, np.ndarray]:
        feeds = {
            "input": ids,
            "input_lengths": np.asarray(lengths, dtype=np.int64),
            "scales": self._scales(speed),
        }
        if "sid" in self._input_names:
            # Multi-speaker voices need a speaker; this library always uses the default.
            feeds["sid"] = np.full(
                len(lengths), self.config.default_speaker_id, np.int64
            )
        return feeds

    def _scales(self, speed: float) -> np.ndarray:
        """[noise_scale, length_scale, noise_w] as the model expects them."""
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be a positive finite number, got {speed!r}")
        length_scale = self.config.length_scale / speed
        return np.asarray(
            [self.config.noise_scale, length_scale, self.config.noise_w],
            dtype=np.float32,
        )


def _check_ids(phoneme_ids: Sequence[int]) -> None:
    if len(phoneme_ids) == 0:
        raise ValueError("phoneme_ids must not be empty")


def _pad(batch: Sequence[Sequence[int]], pad_id: int) -> np.ndarray:
    ids = np.full((len(batch), max(len(s) for s in batch)), pad_id, dtype=np.int64)
    for row, sequence in enumerate(batch):
        ids[row, : len(sequence)] = sequence
    return ids


def _finish(audio: np.ndarray, normalize: bool) -> np.ndarray:
    return peak_normalize(audio) if normalize else audio.astype(np.float32)
