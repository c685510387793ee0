"""The server's configuration: one frozen tree, built once from `loom serve`'s flags (the CLI's
defaults are read from here), and each process handed its part.

`PipelineConfig` and `KVCacheConfig` are MAX's names (max.pipelines); the rest group what one
role reads: the worker takes `model`, `kv_cache`, `device` and `speech` (as its
`RunnerConfig`), the scheduler `batching` and `kv_cache`, the API process `server`. Every
default is written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelines.status import PipelineTask


@dataclass(frozen=True)
class ServedModelConfig:
    model_dir: str  # a checkpoint directory or a GGUF file
    served_model_name: str
    tokenizer_dir: str | None = None  # default: model_dir (a GGUF file's: a cache directory)
    # Activations and KV cache; dense weights too. None: bfloat16 on a GPU, float32 on the CPU.
    dtype: str | None = None
    # None: dense weights in `dtype`; "gguf": a GGUF file's blocks as they are; "int8": a
    # checkpoint's projections quantized to Q8_0 blocks at load time.
    quantization: str | None = None
    max_model_len: int | None = None  # None: the model's own
    # TEXT_GENERATION (a causal LM) or EMBEDDINGS_GENERATION (a sentence encoder)
    task: PipelineTask = PipelineTask.TEXT_GENERATION


@dataclass(frozen=True)
class KVCacheConfig:
    block_size: int = 16  # tokens per block (MAX: kv_cache_page_size)
    memory: int | None = None  # bytes; None: derived from the RAM free after the weights
    enable_prefix_caching: bool = True
    events_endpoint: str | None = None  # publish KV cache events there (off: None)
    events_topic: str = ""


@dataclass(frozen=True)
class BatchingConfig:
    max_num_seqs: int = 64  # requests in one step
    max_num_batched_tokens: int = 512  # tokens in one step (longer prompts go in chunks)
    max_embedding_batch_tokens: int = 8192  # padded tokens per embeddings forward


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"  # the worker's model: "cpu", "cuda[:N]", or "auto" (CUDA if present)
    gpu_memory_utilization: float = 0.9  # of a GPU's memory, for weights + activations + KV
    cuda_graphs: bool = True  # decode-only steps replay CUDA graphs (worker/cuda_graphs.py)
    num_threads: int | None = None  # the worker's; None: every core
    cpu_placement: bool = True  # bind the worker's threads, keep the others off its core
    # Worker processes one model is split over (worker/tensor_parallel.py); the threads above
    # are shared among them.
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class SpeechConfig:
    enabled: bool = True  # serve the default voice beside a text model ([tts] extra)
    noise: bool = True  # False: noise scales 0, deterministic audio


@dataclass(frozen=True)
class AdmissionLimits:
    max_queued_requests: int = 512  # requests sent but not yet producing their first token
    max_queued_tokens: int = 1_000_000  # their prompt tokens
    step_timeout: float = 120.0  # work in flight but no step finished for this long: stalled


@dataclass(frozen=True)
class MediaLimits:
    max_images: int = 4  # per request (vLLM's --limit-mm-per-prompt)
    max_image_bytes: int = 20_000_000  # of an image file, after base64 decoding
    max_image_pixels: int = 40_000_000
    max_request_image_pixels: int = 64_000_000  # all images of a request, from their headers
    # Server-wide: pixels being decoded, then held as pixel arrays until their request ends;
    # float32 arrays of 3 channels: 12 bytes a pixel, in the API process and in the scheduler.
    max_image_pixels_in_flight: int = 256_000_000
    allowed_local_media_path: str | None = None  # file:// URLs only inside it; None: refused


@dataclass(frozen=True)
class HttpLimits:
    """What one connection may hold before its request is served (api_server/http_protocol.py)."""
    max_header_bytes: int = 64 << 10  # the request line and the header fields together (431)
    max_headers: int = 100  # header fields (431)
    header_timeout: float = 10.0  # seconds for a whole request head to arrive (408, closed)
    max_connections: int = 2048  # open at once; beyond, one still waiting for a head is closed


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allow_unauthenticated: bool = False
    log_level: str = "info"
    startup_timeout: float = 300.0
    shutdown_timeout: float = 10.0
    request_timeout: float | None = None
    max_request_bytes: int = 16 << 20
    max_sequences_per_request: int = 256
    trust_request_chat_template: bool = False
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    max_parallel_tool_calls: int = 8  # most calls one forced (parallel) tool call may hold
    responses_store_default: bool = True  # /v1/responses `store` when a request leaves it out
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    media: MediaLimits = field(default_factory=MediaLimits)
    http: HttpLimits = field(default_factory=HttpLimits)
    # Browser guards (api_server/cross_site.py): extra Host names a key-less server answers
    # ("*": any), origins allowed cross-origin requests (CORS; "*": any).
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    metrics_public: bool = False  # /metrics without the API key


@dataclass(frozen=True)
class PipelineConfig:
    model: ServedModelConfig
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speech: SpeechConfig = field(default_factory=SpeechConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
