"""Generators: transformers (the embedded SmolLM2 default), llama.cpp, vLLM, OpenAI-compatible HTTP.

Each backend module imports its heavy dependency only when its generator is created.
"""

from .base import BackendError, Generation, Generator

BACKENDS = ("transformers", "llamacpp", "vllm", "openai")


def make_generator(backend: str, model: str = "smollm2", base_url: str | None = None, **options) -> Generator:
    """The generator for a backend name; ``base_url`` is required by (and only used for) ``openai``,
    and so are most ``options`` (``OpenAIGenerator``'s api_key, chat, timeout, max_n_per_request,
    extra_body, max_retries, max_concurrency); ``transformers`` takes ``sampler``, ``batch_size``,
    ``dtype`` and ``device``."""
    if backend == "transformers":
        from .transformers_backend import TransformersGenerator

        extra = set(options) - {"sampler", "batch_size", "dtype", "device"}
        if extra:
            raise ValueError(f"options {sorted(extra)} do not apply to the transformers backend")
        return TransformersGenerator(model, **{k: v for k, v in options.items() if v is not None})
    if options and backend != "openai":
        raise ValueError(f"options {sorted(options)} apply only to the openai backend")
    if backend == "llamacpp":
        from .llamacpp_backend import LlamaCppGenerator

        return LlamaCppGenerator(model)
    if backend == "vllm":
        from .vllm_backend import VLLMGenerator

        return VLLMGenerator(model)
    if backend == "openai":
        if not base_url:
            raise ValueError("the openai backend needs a base_url")
        from .openai_backend import OpenAIGenerator

        return OpenAIGenerator(base_url, model, **options)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def load_policy(model: str = "smollm2", **options):
    """The policy a policy-bt head featurizes with (``rewards.policy_bt.PolicyFeaturizer``): a
    ``TransformersGenerator`` of ``model`` with ``options`` (dtype, device, batch_size):
    ``pipeline.load_reward`` passes it to ``rewards.reward_from_spec(policy_loader=)``."""
    return make_generator("transformers", model, **options)


__all__ = ["BACKENDS", "BackendError", "Generation", "Generator", "load_policy", "make_generator"]
