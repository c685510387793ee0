"""Batched sampling: greedy, temperature, top-k, top-p, min-p, each request with its own RNG.

A request's random draws come from its own `torch.Generator`, seeded with its `seed`, so the
same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pipelines.sampling_params import SamplingParams


@dataclass
class RequestSamplingState:
    """What the worker keeps per request between steps."""

    params: SamplingParams
    generator: torch.Generator
    output_tokens: list[int] = field(default_factory=list)
    prompt_tokens: torch.Tensor | None = None  # only kept for the repetition penalty
    stop_ids: torch.Tensor | None = None  # EOS and stop ids, masked until min_tokens
    logit_bias_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    logprobs: int = 0  # top-N log probabilities per sampled token (0: none)
    # Prompt log probabilities (echo): the next prompt position due, and a row carried
    # over from the previous prefill chunk.
    echo_logprobs: bool = False
    prompt_len: int = 0
    echo_next: int = 1
    echo_carry: torch.Tensor | None = None
    matcher: object | None = None  # llguidance matcher for constrained decoding
    error: str | None = None  # why this request failed (it samples no more)

    @classmethod
    def create(cls, params: SamplingParams, eos_token_ids: list[int] = (),
               logit_bias: dict[int, float] | None = None, logprobs: int = 0,
               prompt_tokens: np.ndarray | None = None, echo_logprobs: bool = False,
               prompt_len: int = 0) -> "RequestSamplingState":
        generator = torch.Generator()
        generator.manual_seed(params.seed)
        state = cls(params, generator, logprobs=logprobs, echo_logprobs=echo_logprobs,
                    prompt_len=prompt_len)
        stop_ids = sorted(set(eos_token_ids) | set(params.stop_token_ids or ()))
        if params.min_new_tokens and stop_ids:
            state.stop_ids = torch.tensor(stop_ids, dtype=torch.long)
        if logit_bias:
            state.logit_bias_ids = torch.tensor(list(logit_bias), dtype=torch.long)
            state.logit_bias_values = torch.tensor(list(logit_bias.values()), dtype=torch.float32)
        if prompt_tokens is not None and params.repetition_penalty != 1.0:
            state.prompt_tokens = torch.from_numpy(np.asarray(prompt_tokens, dtype=np.int64))
        return state

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    def masked_until_min_tokens(self) -> bool:
        return self.stop_ids is not None and len(self.output_tokens) < self.params.min_new_tokens


def sample(logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
    """One token per row of `logits` [B, V] (float32); returns int64 [B]."""
    tokens = argmax_rows(logits)
    random_rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        # (index_select: ~5x faster than indexing by a tensor, 157k-wide rows)
        tokens[rows] = _sample_random(logits.index_select(0, rows),
                                      [states[i] for i in random_rows])
    return tokens


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, int64 [B]. On the CPU numpy's: ~10x faster than PyTorch's there
    (262,144 logits, one thread: 57 against 620 us; 16 greedy Gemma 3 rows paid ~10 ms a
    step), and the same index (the first maximum; a NaN counts as the maximum)."""
    if logits.is_cpu and logits.dtype == torch.float32:  # (is_cpu: no torch.device made)
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample_isolated(logits: torch.Tensor, states: list[RequestSamplingState],
                    ) -> tuple[torch.Tensor, dict[int, str]]:
    """`sample`, where a row that raises fails alone: the batch is drawn at once, and only if
    that raises, row by row, to find the culprits. Returns the tokens (0 in a failed row) and
    each failed row's error. (A row drawn before the failure then draws again: its token is
    still a fair draw, though not its seed's usual one.)"""
    try:
        return sample(logits, states), {}
    except Exception:
        pass
    tokens = torch.zeros(len(states), dtype=torch.long)
    errors = {}
    for row, state in enumerate(states):
        try:
            tokens[row] = sample(logits[row : row + 1], [state])[0]
        except Exception as exc:
            errors[row] = describe(exc)
    return tokens, errors


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _sample_random(logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
    """Draws for `logits`, a copy of the random rows (scaled in place)."""
    probs, token_ids = _filtered_probs(logits, [s.params for s in states], in_place=True)
    choice = _draw(probs, states)
    if token_ids is None:
        return choice
    return token_ids.gather(1, choice.unsqueeze(1)).squeeze(1)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws a row from, over the vocabulary ([n, V] rows of one
    request), normalized: what speculative decoding's rejection rule weighs proposals by (it
    accepts a proposal with its probability, so the mass that top-k, top-p and min-p removed
    must not stay in the denominator)."""
    probs, token_ids = _filtered_probs(logits, [params] * len(logits))
    if token_ids is not None:  # (rows padded with zero probabilities: adding keeps them out)
        probs = torch.zeros(logits.shape, dtype=probs.dtype).scatter_add_(1, token_ids, probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams], in_place: bool = False,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature (dividing `logits` itself if `in_place`), then top-k, top-p and min-p: the
    rows' probabilities, in vocabulary order, or (when filtered) those of the kept tokens
    with their token ids."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logits = logits.div_(temps) if in_place else logits / temps
    needs_filter = any(p.top_k > 1 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
    if not needs_filter:
        return logits.softmax(dim=-1), None
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return filter_by_threshold(logits, params)
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    return _filter_sorted(sorted_logits, params), sorted_ids


def _filter_sorted(sorted_logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p and min-p, over logits sorted in descending order: the definition
    (and the path of accelerators, where a batched sort is cheap)."""
    vocab = sorted_logits.shape[-1]
    ranks = torch.arange(vocab, device=sorted_logits.device).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params],
                         device=sorted_logits.device).unsqueeze(1)
    probs = sorted_logits.masked_fill(ranks >= top_k, float("-inf")).softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype,
                         device=probs.device).unsqueeze(1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    outside_p = (probs.cumsum(dim=-1) - probs) >= top_p
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype,
                         device=probs.device).unsqueeze(1)
    below_min_p = probs < min_p * probs[:, :1]
    return probs.masked_fill(outside_p | below_min_p, 0.0)


# On the CPU the filters are thresholds on each row's logits, found without ranking the whole
# vocabulary (sorting 157k logits with their ids took ~25 ms a row on one thread, ~100 ms a
# step for 4 speech streams at top-p 0.8): a peaked row is cut among the tokens near its best
# (`_near_cut`), any other row by a histogram of its mass (`_cut_by_histogram`). The
# exponentials are numpy's: PyTorch's CPU `exp` takes 10-70x longer where its results
# underflow (logits more than 87 below the best, as in every row of a peaked model at a low
# temperature: 2-15 ms a row at 157k, against 0.2-0.7 ms).


def filter_by_threshold(logits: torch.Tensor, params: list[SamplingParams],
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_filter_sorted`'s tokens and probabilities: probabilities [B, K] and their token
    ids [B, K], in vocabulary order. A row keeps the logits at or above the smallest one its
    top-k, top-p and min-p keep (tokens tied with that one all stay; the definition keeps as
    many as its sort puts first). When every row is cut near its best, K is the most tokens
    a row keeps (rows padded with zeros); otherwise the vocabulary, each row's weights
    written in place (a flat row keeps most of it: no list of ids and gathered copies)."""
    values = logits.numpy()
    near = [_near_cut(row, p) for row, p in zip(values, params)]
    if all(cut is not None for cut in near):
        return _padded(near)
    probs = np.empty(values.shape, dtype=np.float32)
    for row, p, cut, out in zip(values, params, near, probs):
        if cut is None:
            _kept_weights(row, p, out)
        else:
            ids, kept = cut
            out.fill(0.0)
            out[ids] = np.exp(kept - kept.max())  # (the best token is always kept)
    rows, vocab = values.shape
    return torch.from_numpy(probs), torch.arange(vocab).expand(rows, vocab)


def _padded(kept_rows: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in kept_rows)
    probs = torch.zeros(len(kept_rows), width)
    token_ids = torch.zeros(len(kept_rows), width, dtype=torch.long)
    for i, (ids, kept) in enumerate(kept_rows):
        probs[i, :len(ids)] = torch.from_numpy(np.exp(kept - kept.max()))
        token_ids[i, :len(ids)] = torch.from_numpy(ids)
    return probs, token_ids


def _kept_weights(values: np.ndarray, p: SamplingParams, out: np.ndarray) -> None:
    """One row's weights e^(logit - best) into `out`, zero where its filters drop a token."""
    best = values.max()
    np.exp(np.subtract(values, best, out=out), out=out)
    if not np.isfinite(best):  # (NaN, +inf or all masked: left to the draw, as the definition)
        return
    floor = _kept_floor(values, out, p)
    if floor > -math.inf:
        out *= values >= floor


# A token more than this below a row's best logit has under e^-20 of its probability: all of
# them together (157k at most) weigh under 4e-4 of it.
FAR_LOGIT_RANGE = 20.0


def _near_cut(values: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray] | None:
    """The kept tokens (ids, logits) of a row filtered by top-p and min-p only, found among
    the tokens near its best, when the far tokens cannot move the cut: top-p's cut is placed
    with the far tokens' mass taken as nothing and as its bound, and must come out the same.
    None when that cannot be shown (then `_kept_floor` ranks the row): one pass over the
    row instead of a sum of exponentials over all of it."""
    vocab = len(values)
    if 0 < p.top_k < vocab:
        return None
    best = values.max()
    if not np.isfinite(best):
        return None
    is_near = values >= best - FAR_LOGIT_RANGE
    if np.count_nonzero(is_near) * 8 > vocab:
        return None
    near = np.flatnonzero(is_near)
    near_values = values[near]
    floor = best + math.log(p.min_p) if p.min_p > 0.0 else -math.inf
    if p.top_p < 1.0:
        ranked = np.sort(near_values)[::-1]
        weights = np.exp((ranked - best).astype(np.float64))
        total = weights.sum()
        far_bound = (vocab - len(near)) * math.exp(-FAR_LOGIT_RANGE)
        # The probability ranked above each near token, and above the first far one (all
        # of the near tokens'): a cut there keeps every near token and no far one.
        above = np.concatenate(([0.0], np.cumsum(weights)))
        cuts = set()
        for z in (total, total + far_bound):
            dropped = above / z >= p.top_p
            if not dropped.any():
                return None  # (the cut may be among the far tokens)
            cuts.add(int(dropped.argmax()))
        if len(cuts) > 1:
            return None
        floor = max(floor, float(ranked[cuts.pop() - 1]))
    if floor < best - FAR_LOGIT_RANGE:
        return None
    kept = near_values >= floor
    return near[kept], near_values[kept]


def _kept_floor(values: np.ndarray, weights: np.ndarray, p: SamplingParams) -> float:
    """The smallest logit of one row that its filters keep (`weights`: e^(logit - best))."""
    vocab = len(values)
    best = float(values.max())
    floor = -math.inf
    if 0 < p.top_k < vocab:
        floor = float(np.partition(values, vocab - p.top_k)[vocab - p.top_k])  # k-th largest
    top_k_floor = floor
    if p.min_p > 0.0:
        floor = max(floor, best + math.log(p.min_p))
    if p.top_p < 1.0:
        if top_k_floor > -math.inf:
            in_top_k = values >= top_k_floor
            values, weights = values[in_top_k], weights[in_top_k]
        floor = max(floor, _cut_by_histogram(values, weights, p.top_p))
    return floor


def _cut_among(values: np.ndarray, weights: np.ndarray, above_start: np.float32,
               total: float, top_p: float) -> float | None:
    """Top-p's last kept logit among `values` (the tokens of one histogram bin, ranked right
    after tokens of probability `above_start`), or None when all of them are kept."""
    if values.min() == values.max():  # (tied: all of them stay whichever is the last)
        return None
    order = np.argsort(values)[::-1]
    # As the definition (in float32 as it, so that a cut exactly at top_p falls alike): a
    # token is dropped once the probability of the tokens above it reaches top_p.
    probs = weights[order] / np.float32(total)
    above = np.empty_like(probs)
    above[0] = above_start
    np.cumsum(probs[:-1], out=above[1:])
    above[1:] += above_start
    dropped = above >= top_p
    if not dropped.any():
        return None
    return float(values[order[max(int(dropped.argmax()) - 1, 0)]])


# A flat row keeps tens of thousands of tokens: rather than sort them, their probability is
# summed in bins of their weights, and only the bin where the top-p cut falls is sorted. A
# bin is a weight's float32 exponent and first 7 mantissa bits (a positive float's bits
# order as the float, and the weights as the logits): 1/128 of an octave, 0.005 of a logit.
WEIGHT_BIN_SHIFT = 16


def _cut_by_histogram(values: np.ndarray, weights: np.ndarray, top_p: float) -> float:
    """The logit of the last token of the shortest prefix of the row's ranking whose
    probability reaches top_p (`weights`: e^(logit - best))."""
    total = float(weights.sum(dtype=np.float64))
    bins = np.empty(len(weights), dtype=np.intp)
    np.right_shift(weights.view(np.int32), WEIGHT_BIN_SHIFT, out=bins)
    mass = np.bincount(bins, weights=weights)[::-1]  # (highest first)
    # (Summed in float64 as the definition's running sum, then compared in float32 as it.)
    through = (np.cumsum(mass) / total).astype(np.float32)
    reached = through >= top_p
    if not reached.any():  # (rounding: every token is kept)
        return float(values.min())
    # The first bin whose tokens bring the probability to top_p holds the last kept token;
    # every token of the bins above it is kept.
    first = int(reached.argmax())
    in_bin = np.flatnonzero(bins == len(mass) - 1 - first)
    above = through[first - 1] if first else np.float32(0.0)
    cut = _cut_among(values[in_bin], weights[in_bin], above, total, top_p)
    return float(values[in_bin].min()) if cut is None else cut


def _draw(probs: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
    """One token per row with probability proportional to `probs` (unnormalised is fine), by
    inverse CDF: one uniform draw per request from its own generator, then a search in the
    row's running sum. (An exponential race drew one number per vocabulary entry: 16 ms per
    step at batch 16 over a 49k vocabulary, where this takes 0.5 ms.)"""
    u = torch.empty(len(states), 1, dtype=torch.float64)
    for i, state in enumerate(states):
        u[i].uniform_(generator=state.generator)
    cdf = probs.cumsum(dim=-1)
    # The first index whose running sum passes u * total: a zero-probability token adds
    # nothing to the sum, so it is never the first to pass it.
    target = (u * cdf[:, -1:].double()).to(cdf.dtype)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    # Rounding (the target at the total itself, or a vectorised scan's last bit) must never
    # pick a token without mass, such as one a grammar masked: those rows take their argmax.
    massless = probs.gather(1, tokens.unsqueeze(1)).squeeze(1) <= 0
    if massless.any():
        tokens = torch.where(massless, probs.argmax(dim=-1), tokens)
    return tokens
