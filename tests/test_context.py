"""TextContext's token-array layout and lifecycle, as max.pipelines defines it."""

import numpy as np
import pytest

from pipelines import GenerationStatus, SamplingParams, TextContext


def make(n=5, max_length=20, **kw):
    return TextContext(max_length=max_length, tokens=np.arange(10, 10 + n), eos_token_ids={2}, **kw)


def test_fresh_context_is_a_full_prefill():
    ctx = make()
    assert (ctx.start_idx, ctx.active_idx, ctx.end_idx) == (0, 5, 5)
    assert ctx.active_length == 5 and ctx.needs_ce and ctx.is_initial_prompt
    assert ctx.next_tokens.tolist() == [10, 11, 12, 13, 14]
    assert ctx.compute_num_available_steps(100) == 15


def test_update_appends_and_moves_the_window():
    ctx = make()
    ctx.update(99)
    assert (ctx.start_idx, ctx.active_idx, ctx.end_idx) == (5, 6, 6)
    assert ctx.next_tokens.tolist() == [99] and ctx.active_length == 1
    assert not ctx.needs_ce and not ctx.is_initial_prompt
    assert ctx.generated_tokens.tolist() == [99] and ctx.last_generated_token == 99
    out = ctx.to_generation_output()
    assert out.tokens == [99] and out.final_status is GenerationStatus.ACTIVE
    assert ctx.to_generation_output().tokens == []  # delivered once


def test_chunked_prefill_via_token_indices():
    ctx = make(n=10)
    ctx.set_token_indices(active_idx=4)
    assert ctx.next_tokens.tolist() == [10, 11, 12, 13]
    ctx.set_token_indices(start_idx=ctx.active_idx, active_idx=ctx.end_idx)
    assert ctx.next_tokens.tolist() == list(range(14, 20)) and ctx.needs_ce
    ctx.bump_token_indices(active_idx=-2)
    assert ctx.active_idx == 8


def test_eos_stop_ids_and_max_length():
    ctx = make()
    ctx.update(2)
    assert ctx.status is GenerationStatus.END_OF_SEQUENCE and ctx.is_done
    ctx = make(ignore_eos=True, sampling_params=SamplingParams(stop_token_ids=[7]))
    ctx.update(2)
    assert not ctx.is_done
    ctx.update(7)
    assert ctx.status is GenerationStatus.END_OF_SEQUENCE
    ctx = make(n=5, max_length=7)
    ctx.update(50)
    ctx.update(51)
    assert ctx.status is GenerationStatus.MAXIMUM_LENGTH


def test_reset_folds_generated_tokens_into_the_prompt():
    ctx = make()
    ctx.update(50)
    ctx.update(51)
    delivered = ctx.to_generation_output().tokens
    ctx.reset()
    assert (ctx.start_idx, ctx.active_idx, ctx.end_idx) == (0, 7, 7)
    assert ctx.next_tokens.tolist() == [10, 11, 12, 13, 14, 50, 51] and ctx.needs_ce
    ctx.update(52)
    assert delivered == [50, 51] and ctx.to_generation_output().tokens == [52]
    assert ctx.prompt_tokens.tolist() == [10, 11, 12, 13, 14]


def test_token_array_grows_past_its_chunk():
    ctx = make(n=127, max_length=1000)
    for t in range(300):
        ctx.update(t + 100)
    assert ctx.generated_tokens.tolist() == [t + 100 for t in range(300)]


def test_min_token_mask_covers_eos_until_min_tokens():
    ctx = make(sampling_params=SamplingParams(min_new_tokens=2, stop_token_ids=[9]))
    masks = ctx.get_min_token_logit_mask(3)
    assert sorted(masks[0][:, 1].tolist()) == [2, 9] and len(masks[2]) == 0


def test_max_new_tokens_ends_the_context_after_that_many_updates():
    ctx = make(max_length=100, sampling_params=SamplingParams(max_new_tokens=2))
    ctx.update(50)
    assert ctx.status is GenerationStatus.ACTIVE
    ctx.update(51)
    assert ctx.status is GenerationStatus.MAXIMUM_LENGTH and ctx.is_done


def test_eos_and_stop_ids_end_the_context_only_after_min_tokens():
    ctx = make(sampling_params=SamplingParams(min_new_tokens=2, stop_token_ids=[9]))
    ctx.update(2)
    ctx.update(9)
    assert ctx.status is GenerationStatus.ACTIVE  # two tokens, but neither may end it yet
    ctx.update(2)
    assert ctx.status is GenerationStatus.END_OF_SEQUENCE


def test_jump_ahead_feeds_the_token_and_returns_it():
    ctx = make(max_length=100)
    ctx.update(50)
    ctx.jump_ahead(60)
    assert ctx.next_tokens.tolist() == [50, 60]  # both still to be fed to the model
    assert ctx.to_generation_output().tokens == [50, 60] and ctx.num_generated == 2


def test_rollback_removes_undelivered_tokens_and_reopens_the_context():
    ctx = make(max_length=100)
    ctx.update(50)
    assert ctx.to_generation_output().tokens == [50]
    ctx.update(51)
    ctx.update(2)  # EOS, a rejected draft token
    assert ctx.is_done
    ctx.rollback(2)
    assert not ctx.is_done and ctx.end_idx == 6 and ctx.generated_tokens.tolist() == [50]
    assert ctx.next_tokens.tolist() == [50]
    ctx.update(52)
    assert ctx.to_generation_output().tokens == [52]
    with pytest.raises(ValueError):
        ctx.rollback(2)  # 50 was delivered


def test_draft_offset_skips_tokens_the_draft_model_has_seen():
    ctx = make(n=6)
    ctx.set_draft_offset(4)
    assert ctx.next_tokens.tolist() == [14, 15]
    ctx.update(50)
    assert ctx.next_tokens.tolist() == [50]


def test_cache_slot_and_committed_index():
    ctx = make()
    with pytest.raises(ValueError):
        _ = ctx.cache_seq_id
    ctx.assign_to_cache(3)
    assert ctx.cache_seq_id == 3
    ctx.unassign_from_cache()
    with pytest.raises(ValueError):
        _ = ctx.cache_seq_id
    ctx.set_token_indices(committed_idx=4)
    ctx.bump_token_indices(committed_idx=1)
    assert ctx.committed_idx == 5
