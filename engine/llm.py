"""The offline ``LLM``: generate for a list of prompts with continuous batching (vLLM's
``LLM`` names)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from engine.config import DEFAULT_MODEL, EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.snapshot import SnapshotChannel


class LLM:
    """Offline generation with vLLM's names: ``LLM(model=...).generate(prompts, params)``.

    Args:
        model: a model spec (see ``engine.loader``); the embedded SmolLM2-135M-Instruct by
            default.
        **engine_args: any setting of ``EngineConfig``, ``CacheConfig`` or
            ``SchedulerConfig`` by its field name (``dtype``, ``block_size``,
            ``max_num_seqs``, ...; ``engine.config.engine_args()`` lists them with help).

    Raises:
        TypeError: for an unknown engine argument.
        ValueError: for an invalid value, naming the setting.

    Attributes:
        llm_engine: the ``LLMEngine``.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args), offline=True)
        self._counter = itertools.count()
        # the dashboard's view (``python -m engine generate --dashboard-port``): snapshots
        # taken between steps while ``generate`` runs, at once otherwise
        self.snapshots = SnapshotChannel(self.llm_engine)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (``LLMEngine.reset_prefix_cache``)."""
        with self.snapshots.driving():
            return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; continuous batching over all of them.

        Args:
            prompts: one prompt or a list (text, token ids, or ``{"prompt_token_ids": ...}``).
            sampling_params: one for all prompts, or one per prompt.
            use_tqdm: show a progress bar of finished requests.

        Returns:
            One final ``RequestOutput`` per prompt, in input order.

        Raises:
            ValueError: for an invalid prompt (nothing is left queued) or a params list of
                the wrong length; ``InvalidRequestError`` for a request that failed through its
                own input (a structured output's constraint that no text matches).
            RuntimeError: if the engine failed a request.
        """
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (process_prompt names a prompt of another type)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                             f"{len(prompts)} prompts")
        with self.snapshots.driving():  # from the first add: snapshots are taken between steps
            request_ids = self._add_requests(prompts, sampling_params)
            return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's
        chat template (``LLMEngine.chat_prompt``: by default with the generation prompt
        added; ``continue_final_message`` continues the last message instead)."""
        one = not isinstance(messages, (list, tuple)) or not messages or isinstance(messages[0], dict)
        conversations = [messages] if one else messages  # (chat_prompt names a conversation of another type)
        prompts = [self.llm_engine.chat_prompt(conversation, add_generation_prompt, continue_final_message)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add_requests(self, prompts, sampling_params) -> list[str]:
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                request_id = str(next(self._counter))
                params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except ValueError:
            for request_id in request_ids:
                self.llm_engine.abort_request(request_id)
            raise
        return request_ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                self.snapshots.serve()
                for output in engine.step():
                    if output.error is not None:
                        for request_id in request_ids:
                            engine.abort_request(request_id)
                        if output.error_param is not None:  # the request's own fault
                            raise InvalidRequestError(output.error, output.error_param)
                        raise RuntimeError(f"request {output.request_id} failed: {output.error}")
                    finished[output.request_id] = output
                    bar.update()
        return [finished[request_id] for request_id in request_ids]
