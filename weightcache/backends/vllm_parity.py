"""vLLM for ``weightcache parity --engine vllm``: one engine start that records its model's tensor table.

:func:`record_run` starts vLLM on a model (any load format), writes the tensor table of the model it runs
(:func:`weightcache.parity.write_table`) and returns greedy token ids; :func:`record_main` is
``python -m weightcache.backends.vllm SPEC_JSON``, the process the parity runner (``tools/engine_parity``)
starts, one per load format.

Layer L4 (an engine adapter's). Imports vLLM only inside functions; compares nothing itself (the runner does).
Its names are re-exported by :mod:`weightcache.backends.vllm`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import partial
from typing import Any

from .. import parity


def record_run(
    model: str,
    table: str | os.PathLike[str],
    *,
    load_format: str,
    extra: Mapping[str, object] | None,
    engine_args: Mapping[str, Any],
    prompt: list[int],
    max_tokens: int,
) -> list[int]:
    """Start vLLM on ``model``, write the tensor table of the model it runs, and return greedy token ids for
    ``prompt`` (``skip_tokenizer_init``: token ids in, token ids out)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=dict(extra or {}),
        skip_tokenizer_init=True,
        **dict(engine_args),
    )
    llm.apply_model(partial(parity.write_table, path=str(table), load_format=load_format, extra=dict(extra or {})))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def record_main(argv: list[str]) -> None:
    """``python -m weightcache.backends.vllm SPEC_JSON``: one :func:`record_run`, its tokens on the last line."""
    spec = json.loads(argv[0])
    tokens = record_run(
        spec["model"],
        spec["table"],
        load_format=spec["load_format"],
        extra=spec.get("extra"),
        engine_args=spec.get("engine_args", {}),
        prompt=spec["prompt"],
        max_tokens=spec["max_tokens"],
    )
    print("WEIGHTCACHE-TOKENS " + json.dumps(tokens), flush=True)


__all__ = ["record_main", "record_run"]
