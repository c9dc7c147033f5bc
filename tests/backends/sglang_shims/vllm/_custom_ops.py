"""Test-only stand-in for the one vLLM kernel SGLang's RotaryEmbedding imports when it runs neither on CUDA nor as
its CPU engine (which needs the CUDA-only sglang-kernel package): the loader-level tests never run a forward
pass, so the kernel is imported but never called. It is on the path of the SGLang worker processes only.
"""


def rotary_embedding(*args: object, **kwargs: object) -> None:
    raise NotImplementedError("SGLang loader-level tests run no forward pass; this kernel is a stand-in")
