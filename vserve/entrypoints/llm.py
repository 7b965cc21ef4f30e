"""The offline Python API: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from vserve.engine.arg_utils import EngineArgs
from vserve.engine.llm_engine import LLMEngine
from vserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from vserve.sampling_params import SamplingParams


class LLM:
    """An engine plus a tokenizer, driven to completion by `generate` and `chat`.

    `model` defaults to the embedded Gemma-3-270M. Keyword arguments are engine arguments as
    vLLM names them (`dtype`, `max_model_len`, `max_num_seqs`, `enable_prefix_caching`,
    `async_scheduling`, `pipeline_parallel_size`, ...); an unknown one raises `ValueError`.
    `multiprocess=False` runs the engine core inside this process (tests, debugging).
    `shutdown()`, the end of a `with LLM(...) as llm:` block, or dropping the last reference
    stops the engine core and its workers.
    """

    def __init__(
        self, model: str | None = None, *, multiprocess: bool = True, **engine_kwargs
    ) -> None:
        unknown = set(engine_kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
        self.engine_args = EngineArgs(model=model, **engine_kwargs)
        self.engine = LLMEngine.from_engine_args(self.engine_args, multiprocess=multiprocess)
        self.config = self.engine.config
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (the KV blocks stay allocated to nothing); False while a
        request still holds blocks, as in vLLM."""
        return bool(self.engine.client.call_utility("reset_prefix_cache"))

    # -- generate --------------------------------------------------------------------------------
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        data_parallel_rank: int | None = None,
    ) -> list[RequestOutput]:
        """`data_parallel_rank`: run every prompt on that engine (data parallel); by default
        each goes to the least loaded one."""
        prompts = _as_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        self._check_rank(data_parallel_rank)
        processed = []
        for prompt, sp in zip(prompts, params):  # validate everything before adding anything
            text, ids = self.engine.processor.tokenize_prompt(prompt)
            self.engine.processor.check_params(sp, len(ids))
            processed.append(
                (
                    {"prompt": text, "prompt_token_ids": ids}
                    if text is not None
                    else {"prompt_token_ids": ids},
                    sp,
                )
            )
        return self._run(processed, use_tqdm, data_parallel_rank)

    def embed(
        self,
        prompts,
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding: its last-layer hidden states pooled ("last" token or
        "mean") and L2-normalized, as the model folder says (`entrypoints/embedding.py`)
        unless `pooling` / `normalize` are given. Prompts as in `generate`."""
        from vserve.entrypoints.embedding import embedding_params, finish, pooling_config

        config = pooling_config(self.config.model.model)
        params = embedding_params(config)
        if pooling is not None:
            params = params.clone(pooling=pooling)
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        norm = config.normalize if normalize is None else normalize
        results = []
        for out in outs:
            if out.embedding is None:
                raise RuntimeError(f"embedding failed: {out.outputs[0].stop_reason}")
            vector = EmbeddingOutput(finish(out.embedding, norm).tolist())
            results.append(EmbeddingRequestOutput(out.request_id, out.prompt_token_ids, vector))
        return results

    def _check_rank(self, rank: int | None) -> None:
        dp = self.config.data_parallel
        ranks = [dp.rank] if dp.rank is not None else list(range(dp.size))
        if rank is not None and rank not in ranks:
            raise ValueError(f"data_parallel_rank must be one of {ranks}, got {rank!r}")

    def chat(
        self,
        messages,
        sampling_params=None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [
            self.apply_chat_template(
                c,
                chat_template,
                add_generation_prompt,
                continue_final_message,
                chat_template_kwargs,
                tools,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self,
        conversation,
        chat_template=None,
        add_generation_prompt=True,
        continue_final_message=False,
        chat_template_kwargs=None,
        tools=None,
    ) -> dict:
        from vserve.entrypoints.chat import render_chat

        ids = render_chat(
            self.get_tokenizer(),
            conversation,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs or {},
            tools,
        )
        return {"prompt_token_ids": ids}

    # -- internals -------------------------------------------------------------------------------
    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _run(self, processed, use_tqdm: bool, rank: int | None = None) -> list[RequestOutput]:
        ids = []
        try:
            for prompt, sp in processed:
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, sp, data_parallel_rank=rank)
                ids.append(request_id)
            results = self._drain(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return [results[i] for i in ids]

    def _drain(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        bar = _progress(len(ids)) if use_tqdm else None
        results: dict[str, RequestOutput] = {}
        start, num_in, num_out = time.perf_counter(), 0, 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if not out.finished:
                    continue
                results[out.request_id] = out
                if bar is not None:
                    num_in += len(out.prompt_token_ids)
                    num_out += sum(len(o.token_ids) for o in out.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(
                        f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                        f"output: {num_out / elapsed:.2f} toks/s"
                    )
                    bar.update(1)
        if bar is not None:
            bar.close()
        return results

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    return prompts


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
