"""ModelRunner: the worker's TokenGenerator. It holds the PipelineModel, the KV cache and each
request's sampling state, and runs one StepBatch at a time."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from pipelines.checkpoint.gguf_file import dequantize, open_gguf
from pipelines.checkpoint.gguf_tokenizer import is_gguf
from pipelines.checkpoint.model_config import ModelConfig, load_model_config, resolve_max_model_len
from pipelines.config import PipelineConfig
from pipelines.context import FUTURE_TOKEN, TextContext
from pipelines.custom_architectures import load_architectures
from pipelines.lora import LoRARequest
from pipelines.pipeline import (
    KVCacheParams,
    ModelInputs,
    ModelOutputs,
    PagedCausalLM,
    PagedModelInputs,
    PipelineModel,
)
from pipelines.response import LogProbabilities
from serialization.messages import (
    NewRequest,
    PromptLogprobs,
    SequenceFailure,
    StepBatch,
    StepResult,
    TokenLogprobs,
)
from worker.block_weights import load_block_weights, quantize_weights
from worker.cuda_graphs import GRAPH_SAFE_ARCHITECTURES, SINK_BLOCKS, DecodeGraphs
from worker.device import (
    DTYPES,
    dtype_name,
    place_on,
    rank_device,
    resolve_dtype,
)
from worker.fused_decode import FusedDecode
from worker.logits_processors import adjusts_logits, greedy_as_is, process_logits
from worker.logprobs import pack_logprobs, plan_echo, resolve_echo, token_logprobs
from worker.lora import LoRASlots, adapter_dtype
from worker.models.registry import model_class
from worker.packed_linear import pack_linear_layers, packing_pays_off
from worker.quant_linear import QuantLinear
from worker.sampler import RequestSamplingState, describe, probabilities, sample_isolated
from worker.speculative.draft_model import DraftModel
from worker.speculative.rejection import rejection_sample
from worker.structured_output import GrammarCompiler
from worker.tensor_parallel import (
    ShardPlan,
    agree_on_min,
    broadcast_tokens,
    shard_hf_weights,
    use_shared_memory,
    world_size,
)
from worker.weights import load_checkpoint_weights, materialize_on_cpu

logger = logging.getLogger(__name__)

class ModelRunner:
    def __init__(self, pipeline_config: PipelineConfig, rank: int = 0) -> None:
        """`rank`: of this worker among the tensor-parallel ones (0: the one that samples)."""
        started = time.monotonic()
        # Every setting this runner reads, read here.
        model, kv = pipeline_config.model_config, pipeline_config.kv_cache_config
        model_path, block_size = model.model_path, kv.kv_cache_page_size
        self.max_batch_size = pipeline_config.max_batch_size  # (sizes the default KV cache)
        self.kv_cache_memory = kv.kv_cache_memory
        self.device_memory_utilization = kv.device_memory_utilization
        self.cuda_graphs = pipeline_config.device_config.cuda_graphs
        # (--custom-architectures: the user's classes, imported here; a bad one fails start-up.)
        architectures = load_architectures(pipeline_config.custom_architectures)
        self.config = load_model_config(model_path, any_architecture=bool(architectures))
        self.device = rank_device(pipeline_config.devices, rank)
        self.max_batch_input_tokens = pipeline_config.batch_input_tokens_on(self.device.type)
        self.dtype = resolve_dtype(model.dtype, self.device)
        self.quantization = _quantization_on(self.device, model.quantization_encoding)
        self.kv_dtype = _kv_cache_dtype(kv.kv_cache_dtype, self.dtype, self.device,
                                        self.quantization is not None)
        if self.device.type != "cpu" and self.config.vision is not None:
            raise ValueError(f"--device {self.device}: vision-language models run on the CPU "
                             f"for now (--device cpu)")
        self.block_size = block_size
        self.max_model_len = resolve_max_model_len(self.config, model.max_length)
        cls = model_class(self.config, architectures)
        self.tp = _tensor_parallel_plan(pipeline_config.device_config.tensor_parallel_size,
                                        rank, self.config, cls)
        if self.tp is not None:  # (a step's hidden state: at most a full chunk of tokens)
            use_shared_memory(self.max_batch_input_tokens * self.config.hidden_size)
        if any(cls is arch.pipeline_model for arch in architectures):
            self.model = _build_custom_model(cls, pipeline_config, self.device, self.quantization)
        else:
            self.model: PipelineModel = _build_model(cls, pipeline_config, self.config,
                                                     self.dtype, self.quantization, self.tp,
                                                     self.device)
        shard = self.tp.config(self.config) if self.tp else self.config
        self.model.session = self.device
        self.model.kv_params = KVCacheParams(
            dtype=self.kv_dtype, page_size=block_size, max_length=self.max_model_len,
            max_batch_size=self.max_batch_size,
            max_batch_input_tokens=self.max_batch_input_tokens, memory=self.kv_cache_memory,
            gpu_memory_utilization=self.device_memory_utilization, shard=shard,
            whole=self.config,
            largest_shard=ShardPlan.for_rank(self.config, 0, self.tp.size).config(self.config)
            if self.tp else self.config)
        # A draft model (speculative decoding) is loaded before the cache is sized: its
        # weights count in the memory left, and its cache, with as many blocks, in the budget.
        draft = _build_draft_model(pipeline_config, self.device, self.dtype,
                                   self.model.kv_params)
        draft_block = draft.kv_block_bytes if draft is not None else 0
        # (MAX's KVCacheMixin: the one sizing path; every rank takes the smallest count.)
        per_block = self.model.kv_block_bytes
        available = self.model.estimate_kv_cache_size(self.model.estimate_memory_footprint())
        self.num_blocks = agree_on_min(available // (per_block + draft_block))
        if self.num_blocks * block_size < self.max_model_len:
            need = -(-self.max_model_len // block_size) * per_block
            raise MemoryError(
                f"the KV cache holds {self.num_blocks * block_size} tokens, fewer than one "
                f"full-length sequence ({self.max_model_len}); give it at least {need} bytes "
                f"(--kv-cache-memory) or lower --max-model-len"
            )
        # Only the rank that samples constrains: the others never see a grammar.
        self.samples = self.tp is None or self.tp.rank == 0
        self.grammars = GrammarCompiler(model.tokenizer or model_path) if self.samples \
            else None
        graphs = self._uses_cuda_graphs()
        # (With graphs, one block more than the scheduler knows of: padded rows write there.)
        self.kv_manager = self.model.load_kv_manager(
            self.device, (self.num_blocks + (SINK_BLOCKS if graphs else 0)) * per_block)
        self.kv_cache = self.kv_manager.cache
        self.draft: DraftModel | None = None
        if draft is not None:
            self.draft = DraftModel(draft, draft.load_kv_manager(
                self.device, self.num_blocks * draft_block), self.config.vocab_size)
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = DecodeGraphs(self.model, self.kv_cache, block_size,
                                       self.max_model_len, self.max_batch_size, self.num_blocks)
            self.graphs.capture()
        self.requests: dict[str, RequestSamplingState] = {}
        # (Read once: a missing attribute of a torch Module costs a raised AttributeError.)
        self.model_reads_step = getattr(self.model, "reads_step", False)
        self.loras = self._lora_slots(pipeline_config)
        self.lora_of: dict[str, LoRARequest] = {}  # the requests that run an adapter
        self.failing: set[str] = set()  # requests that failed alone (their state says why)
        kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        logger.info(
            "model %s (%s, %s, %s) loaded in %.1fs; KV cache %.2f GiB = %d blocks x %d = %d "
            "tokens; steps of up to %d tokens", model_path, self.config.architecture,
            _weights_name(self.quantization, self.dtype), self.device,
            time.monotonic() - started,
            kv_bytes / (1 << 30), self.num_blocks, block_size,
            self.num_blocks * block_size, self.max_batch_input_tokens,
        )

    def _lora_slots(self, pipeline_config: PipelineConfig) -> LoRASlots | None:
        lora = pipeline_config.lora_config
        if not lora.enable_lora:
            return None
        if self.tp is not None or not isinstance(self.model, PagedCausalLM) \
                or not hasattr(self.model, "layers"):
            raise ValueError("--enable-lora: LoRA adapters are served over one worker's "
                             "Llama-family or Gemma 3 text model (no --tensor-parallel-size)")
        dtype = adapter_dtype(self.dtype, self.quantization is not None)
        slots = LoRASlots(self.model, self.config, lora.max_num_loras, lora.max_lora_rank,
                          dtype, self.device)
        if getattr(self.model, "fused_decode", None) is not None:
            self.model.fused_decode.use_lora(slots)
        return slots

    def _set_lora_step(self, step: StepBatch, states: list[RequestSamplingState]) -> bool:
        """Load the step's adapters and point their hooks at their rows; a request whose
        adapter fails to load fails alone. Returns whether any row runs an adapter."""
        adapters = [self.lora_of.get(rid) for rid in step.request_ids]
        failed = self.loras.load_for_step({a for a in adapters if a is not None})
        for i, adapter in enumerate(adapters):
            if adapter in failed:
                states[i].error = failed[adapter]
                self.failing.add(step.request_ids[i])
                adapters[i] = None
        return self.loras.set_step(adapters, step.query_lens)

    def _uses_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: on one GPU, for the architectures whose forward
        can be captured, unless --enforce-eager."""
        return (self.cuda_graphs and self.device.type == "cuda" and self.tp is None
                and isinstance(self.model, PagedCausalLM)
                and self.config.architecture in GRAPH_SAFE_ARCHITECTURES)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.config.eos_token_ids

    def check(self, step: StepBatch) -> None:
        """Refuse a step whose indices the native kernels could not follow (`check_step`):
        the worker runs it on every step before writing its tokens into the contexts."""
        check_step(step, self.num_blocks, self.block_size, self.max_model_len,
                   self.config.vocab_size)

    def next_token(self, step: StepBatch, contexts: list[TextContext]) -> StepResult:
        """MAX's `TokenGenerator.next_token` in the server's paged form: `contexts` feed
        their windows (start_idx..active_idx, as `step` lays them out: a prefill chunk or a
        decode token each) over the step's block tables, and the per-request responses come
        back as one StepResult's arrays (a TextResponse per sequence, packed). The model runs
        through its contract (`prepare_initial_token_inputs`, `execute`,
        `compute_log_probabilities`); then the runner samples. Requests the scheduler lists
        as finished are released."""
        for new in step.new_requests:
            self.requests[new.request_id] = self._new_state(new)
            if new.lora is not None:
                self.lora_of[new.request_id] = new.lora
        for request_id in step.finished_request_ids:
            self.release(request_id)

        num_seqs = len(step.request_ids)
        out = StepResult(step_id=step.step_id,
                         sampled_token_ids=np.full(num_seqs, -1, dtype=np.int32))
        if num_seqs == 0:
            return out
        states = [self.requests[rid] for rid in step.request_ids]
        with_lora = self.loras is not None and self._set_lora_step(step, states)
        due = np.flatnonzero(step.sample)  # the sequences every rank expects a token for
        # One request's failure ends that request, never the step: seq -> error. A request
        # that failed before is in steps already built behind that one: it samples no more.
        failed = {i: states[i].error for i, rid in enumerate(step.request_ids)
                  if rid in self.failing} if self.failing else {}
        sample_seqs = due[~np.isin(due, list(failed))] if failed else due
        echo_plans = plan_echo(step, states) if self.samples else []
        if failed:
            echo_plans = [p for p in echo_plans if p.seq not in failed]
        # Sequences that verify proposals (speculative decoding) sample apart (`_verify`).
        drafts = step.num_draft_tokens
        verify_seqs = sample_seqs[drafts[sample_seqs] > 0] if drafts is not None \
            else sample_seqs[:0]
        if len(verify_seqs):
            out.num_accepted = np.zeros(num_seqs, dtype=np.int32)
        with torch.inference_mode():
            if self.draft is not None:  # (its proposals replace the scheduler's placeholders)
                out.draft_token_ids = self.draft.propose(
                    step, contexts, np.flatnonzero(drafts) if drafts is not None
                    else np.zeros(0, np.int64))
            try:
                inputs, outputs, logit_seqs, echo_logits, verify_logits = self._forward(
                    step, contexts, sample_seqs, echo_plans, verify_seqs, with_lora)
            finally:
                if with_lora:
                    self.loras.clear_step()
            if outputs.failed_requests:  # (an image that failed to encode: rows discarded)
                for i, rid in enumerate(step.request_ids):
                    if rid in outputs.failed_requests:
                        failed.setdefault(i, outputs.failed_requests[rid])
            if not self.samples:
                self._follow_samples(out, due, states)
                return out
            try:
                if echo_plans:
                    out.prompt_logprobs = self._echo(echo_plans, echo_logits, states, failed)
                plain_seqs = sample_seqs[~np.isin(sample_seqs, verify_seqs)] \
                    if len(verify_seqs) else sample_seqs
                width = max((states[i].logprobs for i in sample_seqs.tolist()), default=0)
                if len(plain_seqs):
                    self._sample(out, inputs, outputs, logit_seqs, states, plain_seqs, failed,
                                 width)
                if len(verify_seqs):
                    self._verify(out, step, outputs, logit_seqs, verify_logits, states,
                                 verify_seqs, failed, width)
                if failed:
                    out.sampled_token_ids[list(failed)] = -1
            finally:  # (a failed sampling too: the other ranks wait for its tokens)
                if self.tp is not None and len(due):
                    broadcast_tokens(out.sampled_token_ids[due])
        if failed:
            self._fail(out, step, states, failed)
        return out

    def _forward(self, step: StepBatch, contexts: list[TextContext], sample_seqs: np.ndarray,
                 echo_plans: list, verify_seqs: np.ndarray, with_lora: bool = False) -> tuple:
        """The model's outputs for the step: (inputs, outputs, the sequence of each
        next_token_logits row, the echo plans' rows' logits, the rows' logits before each
        verifying sequence's last: one per proposed token). On the host, except a GPU's
        next_token_logits when no row echoes or verifies: `_sample` takes plain greedy rows'
        argmax on the device and brings the rest over itself.

        Loom's own models compute only the rows read (`PagedModelInputs.narrow`: the sampling
        sequences' last rows, then the echo rows, then the verifying rows), and their
        decode-only steps replay CUDA graphs where captured; any other model gives every
        context's last row, and every row when echo or verification asks (return_n_logits=-1)."""
        verify_rows = verifying_rows(step, verify_seqs)
        if (self.graphs is not None and not echo_plans and not len(verify_rows)
                and not with_lora and self.graphs.fits(step)):
            logits = self.graphs.run(step, fed_tokens(contexts))
            if len(sample_seqs) < len(contexts):  # (a failed sequence's row left out)
                logits = logits[torch.from_numpy(sample_seqs).to(logits.device)]
            # (left on the device: `_sample` takes greedy rows' argmax there)
            return None, ModelOutputs(next_token_logits=logits), sample_seqs, None, None
        extra = {"step": step} if self.model_reads_step else {}
        if len(verify_rows) and self._verifies_as_decodes(step, echo_plans, with_lora, extra):
            kv = self.kv_manager.inputs(*rows_as_decodes(step), contexts)
        else:
            kv = self.kv_manager.fetch(contexts, step.block_tables)
        every_row = bool(echo_plans) or bool(len(verify_rows))
        inputs = self.model.prepare_initial_token_inputs(
            contexts, kv_cache_inputs=kv,
            return_n_logits=-1 if every_row else 1 if self.samples else 0, **extra)
        narrowed = isinstance(inputs, PagedModelInputs)
        echo_rows = [p.rows for p in echo_plans]
        if narrowed and not self._narrowed_already(inputs, len(contexts), sample_seqs,
                                                   echo_rows, verify_rows):
            # (a rank that does not sample computes no logits: rows of none)
            rows = [last_rows_of(step)[sample_seqs] if self.samples else sample_seqs[:0]]
            inputs.narrow(np.concatenate(rows + echo_rows + [verify_rows]), len(rows[0]))
        fused = getattr(self.model, "fused_decode", None)
        if fused is not None and self.loras is not None:  # (it adds the deltas in C)
            fused.row_slots = self.loras.row_slots if with_lora else None
        outputs = self.model.execute(inputs)
        if every_row:  # (echo and verification read their rows on the host)
            outputs = outputs.to_host()
        if narrowed:
            num_echo = sum(len(r) for r in echo_rows)
            rest = outputs.logits  # (None when no row follows the sampled ones)
            if rest is None or not len(verify_rows):
                return inputs, outputs, sample_seqs, rest, None
            return inputs, outputs, sample_seqs, rest[:num_echo], rest[num_echo:]
        echo = outputs.logits[np.concatenate(echo_rows)] if echo_plans else None
        verify = outputs.logits[verify_rows] if len(verify_rows) else None
        return inputs, outputs, np.arange(len(contexts)), echo, verify

    def _narrowed_already(self, inputs: PagedModelInputs, num_contexts: int,
                          sample_seqs: np.ndarray, echo_rows: list, verify_rows: np.ndarray,
                          ) -> bool:
        """Whether the inputs already compute exactly the rows the runner reads: each
        context's last row, as return_n_logits=1 asks, when every context samples and no row
        echoes or verifies (every decode step). Narrowing them again cost ~0.04 ms a step."""
        return (self.samples and not echo_rows and not len(verify_rows)
                and len(sample_seqs) == num_contexts == inputs.num_sampled
                and len(inputs.logits_rows) == num_contexts)

    def _verifies_as_decodes(self, step: StepBatch, echo_plans: list, with_lora: bool,
                             extra: dict) -> bool:
        """Whether a step of decodes, some verifying proposals, runs as a step of one-token
        rows (`rows_as_decodes`): each proposed token a row of its own over the sequence's
        blocks, its position's KV stored before any row attends (the decode step's order, in
        the fused native step and the Python path alike). So the verifying rows take the
        one-token step's kernels: its speed (the weights read once for all rows), and its
        numbers, which a prefill chunk's kernels round differently (quantized weights: greedy
        output would then drift from the unspeculated one at near ties)."""
        others = step.query_lens[step.num_draft_tokens == 0]
        return (not echo_plans and not with_lora and not extra and not step.images
                and isinstance(self.model, PagedCausalLM) and bool((others == 1).all()))

    def _new_state(self, new: NewRequest) -> RequestSamplingState:
        """A request's sampling state. One that cannot be built (or whose JSON schema does
        not compile) is a state that records why: the request fails at its first step."""
        try:
            state = RequestSamplingState.create(
                new.sampling_params, new.eos_token_ids, new.sampling_params.logit_bias,
                new.logprobs, new.prompt_token_ids, new.echo_logprobs, new.prompt_len)
        except Exception as exc:
            state = RequestSamplingState(new.sampling_params, torch.Generator(),
                                         error=f"sampling parameters: {describe(exc)}")
        if new.json_schema is not None and self.samples and state.error is None:
            try:
                state.matcher = self.grammars.matcher_for(new.json_schema)
            except Exception as exc:  # (never unconstrained: the request fails)
                state.error = f"structured output: the JSON schema failed to compile: {exc}"
        if state.error is not None:
            self.failing.add(new.request_id)
        return state

    def _fail(self, out: StepResult, step: StepBatch, states: list[RequestSamplingState],
              failed: dict[int, str]) -> None:
        """Report the step's failed sequences; their requests sample no more."""
        out.failed = [SequenceFailure(seq, error) for seq, error in failed.items()]
        for seq, error in failed.items():
            request_id = step.request_ids[seq]
            if request_id not in self.failing:
                logger.warning("request %s failed: %s", request_id, error)
                states[seq].error = error
                self.failing.add(request_id)

    def _follow_samples(self, out: StepResult, sample_seqs: np.ndarray,
                        states: list[RequestSamplingState]) -> None:
        """A rank that does not sample takes rank 0's tokens, as rank 0 recorded them: none
        (-1) where a sequence or the whole sampling failed, so that later FUTURE_TOKEN inputs
        agree on every rank."""
        if not len(sample_seqs):
            return
        tokens = np.full(len(sample_seqs), -1, dtype=np.int32)
        broadcast_tokens(tokens)
        out.sampled_token_ids[sample_seqs] = tokens
        for i, token in zip(sample_seqs.tolist(), tokens.tolist()):
            if token >= 0:
                states[i].output_tokens.append(token)

    def release(self, request_id: str) -> None:
        """Forget a finished request's sampling state, and what the model kept for it (its
        KV blocks are the scheduler's)."""
        self.requests.pop(request_id, None)
        self.lora_of.pop(request_id, None)
        self.failing.discard(request_id)
        self.model.release(request_id)
        if self.draft is not None:
            self.draft.release(request_id)

    def _sample(self, out: StepResult, inputs: ModelInputs | None, outputs: ModelOutputs,
                logit_seqs: np.ndarray, states: list[RequestSamplingState],
                sample_seqs: np.ndarray, failed: dict[int, str], width: int = 0) -> None:
        """A token for each of `sample_seqs`, drawn as one batch (`logit_seqs`: the sequence
        of each row of the outputs' next_token_logits). A row whose logits processing,
        grammar, draw or log probabilities raise is added to `failed` alone (the batched
        calls are redone row by row only when they raise: nothing per token)."""
        batch_states = [states[i] for i in sample_seqs.tolist()]
        top_n = [st.logprobs for st in batch_states]
        # Each sampled row's in the outputs: all of them, in order, when as many (both are
        # sorted, and the sampled sequences are among the outputs').
        whole = len(sample_seqs) == len(logit_seqs)
        at = np.arange(len(sample_seqs)) if whole else np.searchsorted(logit_seqs, sample_seqs)
        logits = outputs.next_token_logits
        if not logits.is_cpu:  # (a GPU's: a replayed CUDA graph's, or an eager step's)
            if not failed and all(map(greedy_as_is, batch_states)):
                # Only the tokens cross to the host, not [B, V] float32 logits (64 x 49,152:
                # 12.6 MB a step) for an argmax on the CPU.
                rows = logits if whole else logits[torch.from_numpy(at).to(logits.device)]
                keep_tokens(out, sample_seqs, batch_states, rows.argmax(dim=-1).cpu(), {})
                return
            outputs.next_token_logits = logits = logits.cpu()
        logits = logits if whole else logits[torch.from_numpy(at)]
        # Log probabilities are of the raw logits: sampling adjusts a copy when they are asked.
        logits = logits.clone() if any(top_n) and whole else logits
        errors: dict[int, str] = {}  # rows of this batch
        if failed:  # (its inputs failed: sampled for the batch's sake, never kept)
            errors = {j: failed[s] for j, s in enumerate(sample_seqs.tolist()) if s in failed}
        process_logits(logits, batch_states, errors)
        constrained = [j for j, st in enumerate(batch_states)
                       if st.matcher is not None and j not in errors]
        if constrained:
            tokens = self.grammars.sample(logits, batch_states, constrained, sample_isolated,
                                          errors)
        else:
            tokens, draw_errors = sample_isolated(logits, batch_states)
            errors.update(draw_errors)
        if errors:
            tokens[list(errors)] = 0  # (a valid index for the log probabilities; never sent)
            top_n = [0 if j in errors else n for j, n in enumerate(top_n)]
        logprobs = None
        if any(top_n):
            logprobs = self._logprobs(inputs, outputs, at, len(logit_seqs), tokens, top_n,
                                      errors, width)
        keep_tokens(out, sample_seqs, batch_states, tokens, errors)
        if logprobs is not None:
            out.logprob_seqs = [int(sample_seqs[j]) for j, n in enumerate(top_n) if n > 0]
            out.sampled_logprobs = logprobs
        for j, error in errors.items():
            failed.setdefault(int(sample_seqs[j]), error)

    def _verify(self, out: StepResult, step: StepBatch, outputs: ModelOutputs,
                logit_seqs: np.ndarray, verify_logits: torch.Tensor,
                states: list[RequestSamplingState], verify_seqs: np.ndarray,
                failed: dict[int, str], width: int) -> None:
        """Speculative decoding: each of `verify_seqs` fed k proposed tokens after its last
        one, so it has k + 1 rows of logits. Row j is processed as the one-token step would
        after the first j proposals (penalties, logit_bias and min_tokens see them as
        generated), then the proposals are accepted while they match the argmax (greedy) or
        by the rejection rule (sampled: the output distribution stays the target's), and one
        more token is taken: the correction of the first rejected proposal, or the token after
        them all. Log probabilities (of the raw logits, as the one-token step's) for each new
        token. A sequence that raises fails alone."""
        drafts_of = draft_tokens_of(step, verify_seqs)
        last = torch.from_numpy(np.searchsorted(logit_seqs, verify_seqs))
        offset = 0
        for seq, drafts, row in zip(verify_seqs.tolist(), drafts_of, last.tolist()):
            k = len(drafts)
            rows = torch.cat([verify_logits[offset:offset + k],
                              outputs.next_token_logits[row:row + 1]])
            offset += k
            state = states[seq]
            try:
                tokens, logprobs = verify_proposals(rows, drafts, state, width, self.grammars)
            except Exception as exc:
                failed.setdefault(seq, describe(exc))
                continue
            state.output_tokens.extend(tokens)
            out.sampled_token_ids[seq] = tokens[-1]
            out.num_accepted[seq] = len(tokens) - 1
            if logprobs is not None:
                out.logprob_seqs = out.logprob_seqs + [seq] * len(tokens)
                out.sampled_logprobs = logprobs if out.sampled_logprobs is None \
                    else concat_logprobs(out.sampled_logprobs, logprobs)

    def _logprobs(self, inputs: ModelInputs | None, outputs: ModelOutputs, at: np.ndarray,
                  num_rows: int, tokens: torch.Tensor, top_n: list[int],
                  errors: dict[int, str], width: int = 0) -> TokenLogprobs | None:
        """The sampled tokens' log probabilities for the rows that asked (`top_n`; `at`:
        their rows of the outputs, of `num_rows`), by the model's
        `compute_log_probabilities`, packed for the wire: every row that asks gets the
        batch's widest top-n (the API process keeps each request's own). All at once; should
        that raise, row by row, a row that raises failing alone (its top_n then 0)."""
        width = max(width, *top_n)
        asked = [width if n else 0 for n in top_n]
        try:
            return pack_logprobs(self._model_logprobs(inputs, outputs, at, num_rows, tokens,
                                                      asked), width)
        except Exception:
            pass
        parts = []
        for j, n in enumerate(asked):
            if not n:
                continue
            alone = [0] * len(asked)
            alone[j] = width
            try:
                parts += self._model_logprobs(inputs, outputs, at, num_rows, tokens, alone)
            except Exception as exc:
                errors[j] = f"log probabilities: {describe(exc)}"
                top_n[j] = 0
        return pack_logprobs(parts, width) if parts else None

    def _model_logprobs(self, inputs: ModelInputs | None, outputs: ModelOutputs,
                        at: np.ndarray, num_rows: int, tokens: torch.Tensor,
                        top_n: list[int]) -> list[LogProbabilities]:
        """The model's log probabilities of the sampled rows that ask, in order. Echo is
        not asked of it (batch_echo all False): a prompt's rows span prefill chunks, and the
        runner resolves them across steps (worker/logprobs.py, `_echo`)."""
        next_tokens = torch.zeros(num_rows, dtype=tokens.dtype)
        next_tokens[torch.from_numpy(at)] = tokens
        batch_top_n = [0] * num_rows
        for row, n in zip(at.tolist(), top_n):
            batch_top_n[row] = n
        results = self.model.compute_log_probabilities(inputs, outputs, next_tokens,
                                                       batch_top_n, [False] * num_rows)
        if results is None or len(results) != num_rows:
            raise ValueError("compute_log_probabilities gave no entry for every row")
        wanted = [results[row] for row, n in zip(at.tolist(), top_n) if n]
        if any(lp is None for lp in wanted):
            raise ValueError("compute_log_probabilities gave None for a row that asked")
        return wanted

    def _echo(self, plans: list, logits: torch.Tensor, states: list[RequestSamplingState],
              failed: dict[int, str]) -> list[PromptLogprobs]:
        """Prompt log probabilities (echo), request by request: one that raises fails
        alone."""
        if logits is None:  # (no echo row this step: only carried rows complete, e.g. a
            logits = torch.zeros(0, 0)  # prompt's last chunk of one token)
        results = []
        offset = 0
        for plan in plans:
            n = len(plan.rows)
            try:
                results += resolve_echo([plan], logits[offset : offset + n], states)
            except Exception as exc:
                failed.setdefault(plan.seq, f"prompt log probabilities: {describe(exc)}")
            offset += n
        return results


def keep_tokens(out: StepResult, sample_seqs: np.ndarray, states: list[RequestSamplingState],
                tokens: torch.Tensor, errors: dict[int, str]) -> None:
    """The step's drawn tokens into its result, and each request's own but a failed row's
    (`errors`: rows of this batch)."""
    out.sampled_token_ids[sample_seqs] = tokens.numpy()
    for j, (state, token) in enumerate(zip(states, tokens.tolist())):
        if j not in errors:
            state.output_tokens.append(token)


def verify_proposals(logits: torch.Tensor, drafts: list[int], state: RequestSamplingState,
                     width: int, grammars: GrammarCompiler | None = None,
                     ) -> tuple[list[int], TokenLogprobs | None]:
    """The new tokens of a sequence that proposed `drafts`, from its k + 1 rows of raw
    `logits` (`ModelRunner._verify`), and their log probabilities when it asks. Under a
    grammar (structured output) the proposals it refuses are cut first, each row is masked
    as the one-token step masks it, and the matcher consumes the new tokens."""
    matcher = state.matcher
    if matcher is not None:
        n, allowed = grammars.masks_along(matcher, drafts)
        drafts, logits = drafts[:n], logits[:n + 1]
    raw = logits.clone() if state.logprobs else logits
    for j in range(len(logits) if adjusts_logits(state) else 0):  # (as the one-token step)
        seen = replace(state, output_tokens=state.output_tokens + drafts[:j])
        process_logits(logits[j:j + 1], [seen])
    if matcher is not None:
        grammars.apply_masks(logits, list(range(len(logits))), allowed)
    draft = torch.tensor(drafts, dtype=torch.long)
    if state.params.is_greedy:
        tokens = rejection_sample(logits, draft, greedy=True)
    else:
        tokens = rejection_sample(probabilities(logits, state.params), draft,
                                  generator=state.generator)
    tokens = tokens.tolist()
    if matcher is not None:
        grammars.consume(matcher, tokens)
    if not state.logprobs:
        return tokens, None
    return tokens, token_logprobs(raw[:len(tokens)], torch.tensor(tokens), width)


def rows_as_decodes(step: StepBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seq_lens, query_lens, block_tables) of the step's tokens as one-token rows, in the
    same order: a sequence feeding q tokens becomes q rows at its last q positions, each over
    the sequence's blocks."""
    q = step.query_lens.astype(np.int64)
    last = np.cumsum(q)
    seq_lens = np.repeat(step.seq_lens.astype(np.int64) - last, q) + np.arange(1, last[-1] + 1)
    return seq_lens, np.ones_like(seq_lens), np.repeat(step.block_tables, q, axis=0)


def verifying_rows(step: StepBatch, verify_seqs: np.ndarray) -> np.ndarray:
    """The rows of the step's flat token array before each verifying sequence's last, one per
    proposed token (the last row is sampled from with the others)."""
    if not len(verify_seqs):
        return np.zeros(0, dtype=np.int64)
    last = last_rows_of(step)[verify_seqs]
    k = step.num_draft_tokens[verify_seqs].astype(np.int64)
    return np.concatenate([np.arange(end - n, end) for end, n in zip(last, k)])


def draft_tokens_of(step: StepBatch, seqs: np.ndarray) -> list[list[int]]:
    """Each sequence's proposed tokens: the last num_draft_tokens of what it feeds."""
    last = last_rows_of(step)[seqs]
    k = step.num_draft_tokens[seqs]
    return [step.input_ids[end - n + 1:end + 1].tolist() for end, n in zip(last, k)]


def concat_logprobs(a: TokenLogprobs, b: TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(np.concatenate([a.token_logprobs, b.token_logprobs]),
                         np.concatenate([a.top_token_ids, b.top_token_ids]),
                         np.concatenate([a.top_logprobs, b.top_logprobs]))


def last_rows_of(step: StepBatch) -> np.ndarray:
    """Each sequence's last row of the step's flat token array (the row it samples from)."""
    return np.cumsum(step.query_lens.astype(np.int64)) - 1


def check_step(step: StepBatch, num_blocks: int, block_size: int, max_model_len: int,
               vocab_size: int) -> None:
    """Raises ValueError unless every index the native kernels will follow is in range.

    The kernels trust block ids, positions and lengths (a check per block read would cost them
    dearly): a scheduler bug or a corrupted step must fail this step, not write another
    sequence's KV or outside the cache. A dozen vectorised reductions once per step (35-55 us
    at batch 64 on the 2-core dev machine, ~0.1% of a decode step), lengths first so that no
    later sum can overflow. The slots (block id x block_size + offset) and positions are
    derived from what is checked here, so they are in range too.
    """
    n = len(step.request_ids)
    q, s, tables, ids = step.query_lens, step.seq_lens, step.block_tables, step.input_ids
    if (q.shape != (n,) or s.shape != (n,) or np.shape(step.sample) != (n,) or ids.ndim != 1
            or tables.ndim != 2 or tables.shape[0] != n):
        raise ValueError(f"step {step.step_id}: arrays disagree with its {n} sequences")
    if any(a.dtype.kind not in "iu" for a in (q, s, tables, ids)):
        raise ValueError(f"step {step.step_id}: ids, lengths and block tables must be integers")
    if n == 0:
        if len(ids):
            raise ValueError(f"step {step.step_id}: input ids without sequences")
        return
    longest = int(s.max())
    if q.min() < 1 or (s < q).any() or longest > max_model_len:
        raise ValueError(f"step {step.step_id}: query lengths must be >= 1 and <= the sequence "
                         f"lengths, which must be <= max_model_len ({max_model_len})")
    if int(q.sum(dtype=np.int64)) != len(ids):
        raise ValueError(f"step {step.step_id}: query lengths sum to {int(q.sum())}, not the "
                         f"{len(ids)} input ids")
    if longest > tables.shape[1] * block_size:
        raise ValueError(f"step {step.step_id}: a sequence needs more blocks than its table row")
    if tables.min() < -1 or tables.max() >= num_blocks:
        raise ValueError(f"step {step.step_id}: a block id outside [0, {num_blocks})")
    # Padding (-1) only after the blocks a sequence reads: a row's first padding entry, if it
    # has any, is at or past ceil(seq_len / block_size). (argmin: the first False of a row,
    # or 0 for a row without padding.)
    real = tables >= 0
    first_pad = real.argmin(axis=1)
    needed = (s.astype(np.int64) + (block_size - 1)) // block_size
    if ((first_pad < needed) & ~real.all(axis=1)).any():
        raise ValueError(f"step {step.step_id}: padding among the blocks a sequence reads")
    drafts = step.num_draft_tokens
    if drafts is not None and (np.shape(drafts) != (n,) or drafts.dtype.kind not in "iu"
                               or drafts.min() < 0 or (drafts >= q).any()
                               or ((drafts > 0) & ~step.sample).any()):
        raise ValueError(f"step {step.step_id}: proposals must be fewer than a sampling "
                         f"sequence's fed tokens")
    # (FUTURE_TOKEN, -1, a placeholder the worker fills in, is the only negative id.)
    if len(ids) and (ids.max() >= vocab_size or ids.min() < FUTURE_TOKEN):
        raise ValueError(f"step {step.step_id}: a token id outside [0, {vocab_size})")


def fed_tokens(contexts: list[TextContext]) -> np.ndarray:
    """The tokens the contexts feed this step (their windows), back to back."""
    return np.concatenate([ctx.next_tokens for ctx in contexts])


def _weights_name(quantization: str | None, dtype: torch.dtype) -> str:
    if quantization == "gguf":
        return "GGUF blocks"
    if quantization == "int8":
        return "int8 (Q8_0 blocks)"
    return dtype_name(dtype)


def _quantization_on(device: torch.device, quantization: str | None) -> str | None:
    """The block formats run on the CPU kernels: on a GPU a GGUF file is widened (to the
    device's dtype), and --quantization int8 is refused."""
    if device.type == "cpu" or quantization is None:
        return quantization
    if quantization == "int8":
        raise ValueError("--quantization int8 runs on the CPU kernels; on a GPU serve the "
                         "checkpoint in bfloat16 or float16")
    logger.info("GGUF blocks run on the CPU kernels: widening the file's weights on %s",
                device)
    return None


def _tensor_parallel_plan(size: int, rank: int, config: ModelConfig,
                          cls: type[PipelineModel]) -> ShardPlan | None:
    """This rank's shard of the model, or None when one worker holds it all."""
    if size == 1:
        return None
    if world_size() != size:
        raise RuntimeError("the tensor-parallel process group is not set up")
    if not cls.supports_tensor_parallel:
        raise ValueError(f"--tensor-parallel-size: {config.architecture} is not split yet "
                         f"(text models of the Llama family and Gemma 3 are)")
    return ShardPlan.for_rank(config, rank, size)


def _kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device,
                    quantized: bool) -> torch.dtype:
    """--kv-cache-dtype resolved. auto: bfloat16 beside quantized weights on the CPU (as
    llama.cpp and vLLM serve a GGUF file, with a 16-bit cache: beside 4- to 8-bit weights its
    rounding is the smaller error, and a decode step's attention reads half the bytes), else
    the activations' dtype. A dtype other than the activations' runs on the CPU's attention
    paths only (their kernels widen a bfloat16 cache as they read it); the GPU's Triton and
    SDPA paths keep one dtype."""
    if name == "auto":
        return torch.bfloat16 if quantized and device.type == "cpu" else dtype
    kv_dtype = DTYPES[name]
    if kv_dtype != dtype and device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype {name}: on {device.type} the KV cache takes the "
                         f"model's dtype ({dtype_name(dtype)}); leave it at auto")
    return kv_dtype


def _build_draft_model(pipeline_config: PipelineConfig, device: torch.device,
                       dtype: torch.dtype, kv_params: KVCacheParams) -> PagedCausalLM | None:
    """The draft model of --speculative-method draft (None without one), in the served
    model's dtype (a GGUF file: its blocks, computing in float32), its rotary tables as long
    as the served context, its KV cache laid out for the same block size."""
    path = pipeline_config.speculative_config.draft_model_path
    if pipeline_config.speculative_config.speculative_method != "draft" or path is None:
        return None
    config = load_model_config(path)
    cls = model_class(config)
    if not issubclass(cls, PagedCausalLM) or config.vision is not None:
        raise ValueError(f"--draft-model-path {path}: a text model of the Llama family or "
                         f"Gemma 3 drafts")
    quantization = "gguf" if is_gguf(path) else None
    dtype = torch.float32 if quantization else dtype
    draft_config = pipeline_config.replace(model_path=path, quantization_encoding=quantization,
                                           max_length=kv_params.max_length)
    model = _build_model(cls, draft_config, config, dtype, quantization, None, device)
    model.session = device
    model.kv_params = replace(kv_params, dtype=dtype, shard=config, whole=config,
                              largest_shard=config)
    return model


def _build_custom_model(cls: type, pipeline_config: PipelineConfig, device: torch.device,
                        quantization: str | None) -> PipelineModel:
    """A --custom-architectures class builds itself, its weights included (MAX's contract);
    Loom's loading (quantized or packed layers, the fused decode) is for its own models."""
    if quantization is not None:
        raise ValueError(f"--quantization {quantization}: {cls.__name__} "
                         f"(--custom-architectures) loads its own weights")
    return cls(pipeline_config, device)


def _build_model(cls: type[PipelineModel], pipeline_config: PipelineConfig,
                 config: ModelConfig, dtype: torch.dtype, quantization: str | None = None,
                 shard: ShardPlan | None = None,
                 device: torch.device = torch.device("cpu")) -> PipelineModel:
    """One of Loom's models, `cls(pipeline_config, session)` (this rank's `shard` of it),
    with its weights loaded in the layout its kernels want."""
    full_config = config
    model_path = pipeline_config.model_config.model_path
    # Built on the meta device so no time is spent initialising weights we overwrite.
    with torch.device("meta"):
        model = cls(pipeline_config, device, shard=shard) if shard is not None \
            else cls(pipeline_config, device)
    if quantization is not None:
        if dtype != torch.float32:
            raise ValueError("quantized weights compute in float32: use --dtype float32")
        blocks = _block_weights(model_path, quantization)
        if shard is not None:
            blocks = shard_hf_weights(blocks, full_config, shard)
        load_block_weights(model, blocks)
    else:
        materialize_on_cpu(model)  # (the rotary tables were computed on the CPU already)
        weights = _dense_weights(model_path)
        if shard is not None:
            weights = shard_hf_weights(weights, full_config, shard)
        model.load_hf_weights(weights)
        model.to(dtype)
        if device.type != "cpu":  # PyTorch's kernels on the device, as the weights are
            place_on(model, device)
            logger.info("linear layers: PyTorch's GEMM on %s", device)
            model.eval()
            return model
    if quantization is not None:
        _log_quantized_layers(model)
    if packing_pays_off(dtype):
        packed = pack_linear_layers(model)
        if packed or quantization is None:
            logger.info("linear layers: Loom's packed GEMM kernel (%d layers)", packed)
        if dtype == torch.bfloat16:
            model.compute_in_float32()
        # (One native call for every layer leaves no room for the ranks' all-reduces.)
        model.fused_decode = FusedDecode.for_model(model) if shard is None else None
    else:  # PyTorch's GEMM: no kernel here, float16, or bfloat16 on a CPU with AMX
        logger.info("linear layers: PyTorch's GEMM")
        model.use_fast_weight_layout()
    model.eval()
    return model


def _log_quantized_layers(model: torch.nn.Module) -> None:
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    formats = sorted({m.qtype.name for m in layers})
    kernel = next((m.kernel.isa for m in layers if m.kernel is not None), None)
    interleaved = sum(m.interleaved for m in layers)
    logger.info("linear layers: %d kept in block formats (%s, %d of them interleaved by 8 "
                "rows), %s", len(layers), ", ".join(formats), interleaved,
                f"quantized kernel {kernel}" if kernel
                else "PyTorch fallback (no C compiler: several times slower)")


def _block_weights(model_path: str, quantization: str) -> dict:
    if quantization == "gguf":
        if not is_gguf(model_path):
            raise ValueError("--quantization gguf needs a .gguf file")
        return open_gguf(model_path).tensors
    if quantization == "int8":
        if is_gguf(model_path):
            raise ValueError("--quantization int8 quantizes a checkpoint directory; a GGUF "
                             "file is served in its own formats")
        return quantize_weights(load_checkpoint_weights(model_path), "Q8_0")
    raise ValueError(f"unknown quantization {quantization!r}")


def _dense_weights(model_path: str) -> dict[str, torch.Tensor]:
    """A checkpoint's weights, or a GGUF file's widened to float32 (--dtype on a GGUF)."""
    if is_gguf(model_path):
        return {name: dequantize(t) for name, t in open_gguf(model_path).tensors.items()}
    return load_checkpoint_weights(model_path)
