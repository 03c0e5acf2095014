"""minivllm: a vLLM-style inference engine for Qwen2.5 / Qwen3, built from scratch in plain PyTorch.

The package is built one module per notebook (see docs/architecture.md). The public API
follows vLLM's offline API::

    from minivllm import LLM, SamplingParams, TINY_MODEL
    llm = LLM(model=TINY_MODEL)
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=32))

Heavy modules are imported lazily so that ``import minivllm`` stays cheap and a learner who
has only finished the early notebooks can still import the package.
"""

from pathlib import Path

__version__ = "0.1.0"

#: The bundled tiny Qwen2-architecture checkpoint: the offline default model everywhere.
TINY_MODEL = str(Path(__file__).parent / "assets" / "tiny-qwen2-stdlib")

_LAZY = {
    "LLM": "engine",
    "LLMEngine": "engine",
    "RequestOutput": "engine",
    "CompletionOutput": "engine",
    "SamplingParams": "sampling",
    "EngineConfig": "config",
    "ModelConfig": "config",
}

__all__ = [
    "LLM",
    "TINY_MODEL",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
