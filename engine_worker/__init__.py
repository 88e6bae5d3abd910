"""Quire's inference engine: paged KV cache, continuous batching, vLLM-shaped offline API."""

from engine_worker.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine_worker.config import EngineArgs
from engine_worker.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
                                   Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                                   RequestOutput)
from engine_worker.lora.request import LoRARequest
from engine_worker.pooler_config import PoolerConfig
from engine_worker.pooling_params import PoolingParams
from engine_worker.sampling_params import (RequestOutputKind, SamplingParams,
                                           StructuredOutputsParams)


def __getattr__(name: str):
    # LLM and LLMEngine pull in torch; import them lazily so configs stay light.
    if name == "LLM":
        from engine_worker.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine_worker.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "EngineArgs", "LoRARequest", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "SamplingParams", "StructuredOutputsParams",
           "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics", "PoolingParams",
           "PoolerConfig", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput"]
