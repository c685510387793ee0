"""The worker's part of the configuration (pipelines/config.py holds the defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.config import (
    BatchingConfig,
    DeviceConfig,
    KVCacheConfig,
    PipelineConfig,
    ServedModelConfig,
    SpeechConfig,
)
from pipelines.status import PipelineTask


@dataclass
class RunnerConfig:
    """The worker's part of the configuration (pipelines/config.py, where the defaults are)."""

    model_dir: str  # a checkpoint directory or a GGUF file
    dtype: str | None = ServedModelConfig.dtype  # None: the device's default
    quantization: str | None = ServedModelConfig.quantization  # None, "gguf" or "int8"
    tokenizer_dir: str | None = ServedModelConfig.tokenizer_dir
    block_size: int = KVCacheConfig.block_size
    max_model_len: int | None = ServedModelConfig.max_model_len
    max_num_seqs: int = BatchingConfig.max_num_seqs  # (sizes the default KV cache)
    max_num_batched_tokens: int = BatchingConfig.max_num_batched_tokens  # (a GPU's profiling)
    kv_cache_memory: int | None = KVCacheConfig.memory
    task: PipelineTask = ServedModelConfig.task
    speech: bool = SpeechConfig.enabled
    speech_noise: bool = SpeechConfig.noise
    device: str = DeviceConfig.device
    gpu_memory_utilization: float = DeviceConfig.gpu_memory_utilization
    cuda_graphs: bool = DeviceConfig.cuda_graphs
    tensor_parallel_size: int = DeviceConfig.tensor_parallel_size
    rank: int = 0  # of this worker among tensor_parallel_size (0: the one that samples)

    @classmethod
    def from_pipeline(cls, cfg: PipelineConfig) -> "RunnerConfig":
        m = cfg.model
        return cls(model_dir=m.model_dir, dtype=m.dtype, quantization=m.quantization,
                   tokenizer_dir=m.tokenizer_dir, block_size=cfg.kv_cache.block_size,
                   max_model_len=m.max_model_len, max_num_seqs=cfg.batching.max_num_seqs,
                   max_num_batched_tokens=cfg.batching.max_num_batched_tokens,
                   kv_cache_memory=cfg.kv_cache.memory, task=m.task,
                   speech=cfg.speech.enabled, speech_noise=cfg.speech.noise,
                   tensor_parallel_size=cfg.device.tensor_parallel_size,
                   device=cfg.device.device,
                   gpu_memory_utilization=cfg.device.gpu_memory_utilization,
                   cuda_graphs=cfg.device.cuda_graphs)
