import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct generator, loaded once for the whole run."""
    from privalign.backends.transformers_backend import TransformersGenerator

    return TransformersGenerator("smollm2")
