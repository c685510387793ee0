"""TextContext: the token array and indices of one request, as max.pipelines.core lays it out.

Token array layout:

    +---------- full prompt ----------+                  CHUNK_SIZE*N v
    +--------------------+---------------+-----------------+----------------+
    |     completed      |  next_tokens  |                 |  preallocated  |
    +--------------------+---------------+-----------------+----------------+
               start_idx ^    active_idx ^         end_idx ^

- completed: tokens already processed (their KV is in the cache).
- next_tokens: tokens processed in the next step; a subset of the prompt under chunked prefill.
- end_idx: one past the last valid token.

The context is built in the API process, msgpack-encoded and sent to the scheduler, which owns it
from then on. It carries no KV state: block tables live in the scheduler's BlockManager.
"""

from __future__ import annotations

import uuid

import msgspec
import numpy as np

from pipelines.lora import LoRARequest
from pipelines.response import LogProbabilities, TextGenerationOutput
from pipelines.sampling_params import SamplingParams
from pipelines.status import GenerationStatus

CHUNK_SIZE = 128
# Stands for a token the worker is still sampling (overlap scheduling); the worker feeds the
# token it sampled last for that request wherever it sees one.
FUTURE_TOKEN = -1


def _new_request_id() -> str:
    return uuid.uuid4().hex


class TextContext(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True, eq=False):
    # eq=False: a context is one request's mutable state; two are equal only if they are the same.

    max_length: int
    tokens: np.ndarray
    request_id: str = msgspec.field(default_factory=_new_request_id)
    eos_token_ids: set[int] = msgspec.field(default_factory=set)
    eos_sequences: list[list[int]] = msgspec.field(default_factory=list)
    log_probabilities: int = 0
    log_probabilities_echo: bool = False
    ignore_eos: bool = False
    json_schema: str | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    model_name: str = ""
    # Keys the request's prefix-cache blocks apart (vLLM's field): requests with different
    # salts never share KV blocks, so one tenant can't probe another's prompts by hit timing.
    cache_salt: str | None = None
    # The LoRA adapter it runs with (None: the base model), set by the API process; its
    # prefix-cache blocks are keyed by it too.
    lora: LoRARequest | None = None
    # Extension: False keeps the request out of speculative decoding (it never proposes).
    speculative_decoding: bool = True
    status: GenerationStatus = GenerationStatus.ACTIVE
    _size: int = -1
    _start_idx: int = 0
    _active_idx: int = -1
    _end_idx: int = -1
    _completion_start_idx: int = -1
    _completion_end_idx: int = -1
    _prompt_len: int = -1
    _log_probabilities_data: dict[int, LogProbabilities] = msgspec.field(default_factory=dict)
    _is_initial_prompt: bool = True
    _draft_offset: int = 0
    _num_future: int = 0  # placeholders at the end of the tokens, oldest first
    _cache_seq_id: int | None = None
    _committed_idx: int = 0
    target_endpoint: str | None = None

    @property
    def prefix_salt(self) -> str | tuple | None:
        """What keys its prefix-cache blocks apart: its cache_salt, and its adapter (two
        adapters, or an adapter and the base, compute different KV for the same tokens)."""
        if self.lora is None:
            return self.cache_salt
        return (self.cache_salt, self.lora.name, self.lora.path)

    def __post_init__(self) -> None:
        if self._end_idx != -1:  # decoded from the wire: indices are already set
            return
        prompt = np.asarray(self.tokens, dtype=np.int64).reshape(-1)
        n = len(prompt)
        if n == 0:
            raise ValueError("a context needs at least one prompt token")
        self._size = _round_up(n, CHUNK_SIZE)
        self.tokens = np.zeros(self._size, dtype=np.int64)
        self.tokens[:n] = prompt
        self._start_idx = 0
        self._active_idx = self._end_idx = self._prompt_len = n
        self._completion_start_idx = self._completion_end_idx = n

    # ---- indices -------------------------------------------------------------------------
    @property
    def start_idx(self) -> int:
        return self._start_idx

    @property
    def active_idx(self) -> int:
        return self._active_idx

    @property
    def end_idx(self) -> int:
        return self._end_idx

    @property
    def active_length(self) -> int:
        """Number of tokens input this step: the (chunk of the) prompt, or 1 when decoding."""
        return self._active_idx - self._start_idx

    @property
    def current_length(self) -> int:
        """Length of the sequence, completed and active tokens."""
        return self._end_idx

    @property
    def processed_length(self) -> int:
        """Tokens whose KV is already in the cache."""
        return self._start_idx

    @property
    def prompt_length(self) -> int:
        return self._prompt_len

    @property
    def num_generated(self) -> int:
        return self._end_idx - self._prompt_len

    @property
    def committed_idx(self) -> int:
        """Tokens whose KV blocks the prefix cache holds (full blocks it can share)."""
        return self._committed_idx

    @property
    def next_tokens(self) -> np.ndarray:
        return self.tokens[self._start_idx + self._draft_offset : self._active_idx]

    @property
    def all_tokens(self) -> np.ndarray:
        return self.tokens[: self._end_idx]

    @property
    def prompt_tokens(self) -> np.ndarray:
        return self.tokens[: self._prompt_len]

    @property
    def generated_tokens(self) -> np.ndarray:
        return self.tokens[self._prompt_len : self._end_idx]

    @property
    def prefix_cache_tokens(self) -> np.ndarray:
        """The tokens the prefix cache hashes (a vision context keys its images in them)."""
        return self.tokens

    @property
    def last_generated_token(self) -> int:
        if self._end_idx <= self._prompt_len:
            raise ValueError("no tokens have been generated yet")
        return int(self.tokens[self._end_idx - 1])

    @property
    def needs_ce(self) -> bool:
        """True while more than the last token still has to be encoded (prefill)."""
        return self._end_idx - self._start_idx > 1 or self._is_initial_prompt

    @property
    def is_initial_prompt(self) -> bool:
        return self._is_initial_prompt

    @property
    def is_done(self) -> bool:
        return self.status.is_done

    @property
    def min_tokens(self) -> int:
        return self.sampling_params.min_new_tokens

    def bump_token_indices(self, start_idx: int = 0, active_idx: int = 0, end_idx: int = 0,
                           committed_idx: int = 0) -> None:
        self.set_token_indices(
            self._start_idx + start_idx, self._active_idx + active_idx, self._end_idx + end_idx,
            self._committed_idx + committed_idx,
        )

    def set_token_indices(
        self,
        start_idx: int | None = None,
        active_idx: int | None = None,
        end_idx: int | None = None,
        committed_idx: int | None = None,
    ) -> None:
        new_start = self._start_idx if start_idx is None else start_idx
        new_active = self._active_idx if active_idx is None else active_idx
        new_end = self._end_idx if end_idx is None else end_idx
        if not 0 <= new_start <= new_active <= new_end <= self._size:
            raise ValueError(
                f"invalid token indices start={new_start} active={new_active} end={new_end}"
            )
        self._start_idx, self._active_idx, self._end_idx = new_start, new_active, new_end
        if committed_idx is not None:
            if not 0 <= committed_idx <= new_end:
                raise ValueError(f"invalid committed_idx {committed_idx} (end={new_end})")
            self._committed_idx = committed_idx

    # ---- cache slot ---------------------------------------------------------------------
    @property
    def cache_seq_id(self) -> int:
        """The cache slot the context holds (the worker's row for it); raises if none."""
        if self._cache_seq_id is None:
            raise ValueError(f"context {self.request_id} is not assigned to a cache slot")
        return self._cache_seq_id

    def assign_to_cache(self, cache_seq_id: int) -> None:
        self._cache_seq_id = cache_seq_id

    def unassign_from_cache(self) -> None:
        self._cache_seq_id = None

    def compute_num_available_steps(self, max_seq_len: int) -> int:
        """How many tokens can still be generated before reaching max_seq_len."""
        return max(0, min(max_seq_len, self.max_length) - self._end_idx)

    # ---- generation ---------------------------------------------------------------------
    def update(self, new_token: int, log_probabilities: LogProbabilities | None = None) -> None:
        """Append a generated token; the tokens fed this step become completed."""
        if self._end_idx >= self._size:
            self._grow(CHUNK_SIZE)
        self.tokens[self._end_idx] = new_token
        if log_probabilities is not None:
            self._log_probabilities_data[self._end_idx] = log_probabilities
        self._start_idx = self._active_idx
        self._active_idx = self._end_idx + 1
        self._end_idx += 1
        self._completion_end_idx += 1
        self._is_initial_prompt = False
        self._draft_offset = 0
        self._update_status(new_token)

    @property
    def num_future(self) -> int:
        """Placeholder tokens not yet replaced by the sampled ones."""
        return self._num_future

    def update_with_future_token(self) -> None:
        """Append a placeholder for the token the step just scheduled will sample, advancing
        the indices as `update` would, so the next step can be scheduled before this one
        finishes (overlap scheduling). `realize_future_token` fills it in."""
        if self._end_idx >= self._size:
            self._grow(CHUNK_SIZE)
        self.tokens[self._end_idx] = FUTURE_TOKEN
        self._start_idx = self._active_idx
        self._active_idx = self._end_idx + 1
        self._end_idx += 1
        self._is_initial_prompt = False
        self._num_future += 1

    def realize_future_token(
        self, new_token: int, log_probabilities: LogProbabilities | None = None
    ) -> None:
        """Overwrite the oldest placeholder with the sampled token. If that token ends the
        request, later placeholders (steps already scheduled past it) are dropped."""
        at = self._end_idx - self._num_future
        self.tokens[at] = new_token
        if log_probabilities is not None:
            self._log_probabilities_data[at] = log_probabilities
        self._num_future -= 1
        self._completion_end_idx += 1
        self._update_status(new_token, end=at + 1)
        if self.is_done and self._num_future:
            self._end_idx -= self._num_future
            self._active_idx = self._end_idx
            self._start_idx = min(self._start_idx, self._end_idx)
            self._num_future = 0

    def jump_ahead(self, new_token: int) -> None:
        """Append a token that still has to be fed to the model, and return it to the user."""
        if self._end_idx >= self._size:
            self._grow(CHUNK_SIZE)
        self.tokens[self._end_idx] = new_token
        self._active_idx += 1
        self._end_idx += 1
        self._completion_end_idx += 1
        self._update_status(new_token)

    def _update_status(self, new_token: int, end: int | None = None) -> None:
        """Status after `new_token`, the last of the tokens up to `end` (default: all): a stop
        token id or EOS ends it once `min_tokens` are generated, `max_new_tokens` and
        `max_length` cap it. (Stop strings are the API process's: it holds the text.)"""
        end = self._end_idx if end is None else end
        params = self.sampling_params
        generated = end - self._prompt_len
        if generated > params.min_new_tokens and (  # (EOS is masked for min_tokens tokens)
                (params.stop_token_ids and new_token in params.stop_token_ids)
                or (not self.ignore_eos and self._is_eos(new_token, end))):
            self.status = GenerationStatus.END_OF_SEQUENCE
        elif end >= self.max_length or (params.max_new_tokens is not None
                                        and generated >= params.max_new_tokens):
            self.status = GenerationStatus.MAXIMUM_LENGTH

    def _is_eos(self, new_token: int, end: int) -> bool:
        if new_token in self.eos_token_ids:
            return True
        for seq in self.eos_sequences:
            n = len(seq)
            if n and end - n >= self._prompt_len:
                if self.tokens[end - n : end].tolist() == seq:
                    return True
        return False

    def rollback(self, idx: int) -> None:
        """Remove the last `idx` generated tokens (a draft's rejected ones, speculative
        decoding): the indices move back past them, their log probabilities go, and the
        context is active again. Tokens already delivered to the user cannot be taken back."""
        if idx <= 0:
            return
        if self._num_future:
            raise ValueError("rollback with a step in flight")
        new_end = self._end_idx - idx
        if new_end < max(self._prompt_len, self._completion_start_idx):
            raise ValueError(f"cannot roll back {idx} tokens: only "
                             f"{self._end_idx - max(self._prompt_len, self._completion_start_idx)}"
                             f" undelivered generated tokens")
        for i in range(new_end, self._end_idx):
            self._log_probabilities_data.pop(i, None)
        self._end_idx = new_end
        self._active_idx = new_end
        self._start_idx = min(self._start_idx, new_end - 1)
        self._committed_idx = min(self._committed_idx, new_end)
        self._completion_end_idx = new_end
        self._draft_offset = 0
        self.status = GenerationStatus.ACTIVE

    def append_draft(self, draft: np.ndarray) -> None:
        """Append proposed tokens (speculative decoding) to the window, to be fed with it and
        verified: they are not generated tokens (no status change, nothing to deliver), and
        `rollback(len(draft))` takes them off once the step's result is known."""
        n = len(draft)
        if self._end_idx + n > self._size:
            self._grow(_round_up(self._end_idx + n - self._size, CHUNK_SIZE))
        self.tokens[self._end_idx : self._end_idx + n] = draft
        self._end_idx += n
        self._active_idx = self._end_idx

    def set_draft_offset(self, idx: int) -> None:
        """The draft model's window starts `idx` tokens past `start_idx` (it has already seen
        them): `next_tokens` leaves them out until the next `update`."""
        if not 0 <= idx <= self._active_idx - self._start_idx:
            raise ValueError(f"draft offset {idx} outside the active window")
        self._draft_offset = idx

    def get_min_token_logit_mask(self, num_steps: int) -> list[np.ndarray]:
        """Per step, the (row, token) pairs to mask so EOS can't be sampled before min_tokens."""
        masks = []
        eos = sorted(self.eos_token_ids | set(self.sampling_params.stop_token_ids or ()))
        for step in range(num_steps):
            generated = self.num_generated + step
            if generated < self.min_tokens and eos:
                masks.append(np.array([[0, t] for t in eos], dtype=np.int32))
            else:
                masks.append(np.zeros((0, 2), dtype=np.int32))
        return masks

    def reset(self) -> None:
        """Fold every token into a new prompt, so the context is re-encoded from scratch.

        Used on preemption: the KV blocks are freed, and the next time the context is scheduled
        all of its tokens (prompt and generated so far) are prefilled again. Tokens already
        returned to the user stay returned.
        """
        self._start_idx = 0
        self._active_idx = self._end_idx
        self._is_initial_prompt = True

    def to_generation_output(self) -> TextGenerationOutput:
        """The tokens generated since the last call, and the status; marks them delivered."""
        start, end = self._completion_start_idx, self._completion_end_idx
        tokens = self.tokens[start:end].tolist()
        logprobs = None
        if self._log_probabilities_data:
            logprobs = [self._log_probabilities_data.pop(i) for i in range(start, end)
                        if i in self._log_probabilities_data]
        self._completion_start_idx = end
        return TextGenerationOutput(
            request_id=self.request_id,
            tokens=tokens,
            final_status=self.status,
            log_probabilities=logprobs or None,
        )

    def _grow(self, by: int) -> None:
        self.tokens = np.concatenate([self.tokens, np.zeros(by, dtype=self.tokens.dtype)])
        self._size += by


def _round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple
