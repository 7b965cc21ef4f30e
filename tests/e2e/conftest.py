import pytest

from tests.support.engines import make_llm


@pytest.fixture(scope="package")
def embedded_fp32():
    """`get(quantization)`: the embedded model in an in-process fp32 engine, built once for
    the e2e package (test_embedded_model and test_quantized_model share it): `None` for the
    default (the GGUF's own blocks), "none" for the GGUF dequantized at load. Room for
    test_quantized_model's 1024-token text, in prefill chunks of 512."""
    built = {}

    def get(quantization: str | None):
        if quantization not in built:
            extra = {} if quantization is None else {"quantization": quantization}
            built[quantization] = make_llm(
                None, max_model_len=2048 + 16, max_num_batched_tokens=512, **extra
            )
        return built[quantization]

    yield get
    for llm in built.values():
        llm.shutdown()
