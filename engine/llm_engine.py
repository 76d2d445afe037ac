"""``LLMEngine``: requests in, one scheduled step at a time, ``RequestOutput``s out."""
from __future__ import annotations

import logging
from collections.abc import Collection

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import ContextLengthExceededError, InvalidRequestError, excerpt
from engine.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tool_calls import conversation_for_template, conversation_with_tools, template_takes_tools

logger = logging.getLogger(__name__)

# A prompt: text, token ids, or {"prompt": text, "prompt_token_ids": ids} (vLLM's forms).
PromptType = str | list[int] | dict
_COMPILE_POLL_S = 0.02  # how long a step with nothing to run waits for a grammar compile
# Steps in a row that may fail outside the forward pass, each failing every request, before
# the exception stops the engine (LLMEngine.step).
MAX_CONSECUTIVE_FAILED_STEPS = 3

# Unicode normalization can merge characters before tokenization: NFC composes at most 4
# code points into one (a canonical decomposition is at most 4 long, Unicode's UAX #15).
_NORMALIZER_SHRINK = 4


class LLMEngine:
    """The engine core: scheduler, block manager, model runner and detokenizers.

    Not thread-safe: one caller (``LLM`` or ``AsyncLLM``'s loop thread) drives it.

    Args:
        config: engine settings.
        loaded: an already loaded model; loaded from ``config.model`` when ``None``.
        offline: the caller steps the engine in a process that runs nothing else meanwhile
            (the offline ``LLM``, not ``AsyncLLM``): see ``LlamaForCausalLM.compile_glue``.

    Raises:
        ValueError: if ``max_model_len`` exceeds the model's ``max_position_embeddings``.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, offline: bool = False) -> None:
        loaded = loaded or load_model(config.model)
        model_max = loaded.config.max_position_embeddings
        sched = config.scheduler
        if sched.max_model_len is None:
            sched.max_model_len = model_max
        elif sched.max_model_len > model_max:
            raise ValueError(f"max_model_len ({sched.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({model_max})")
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_id = _eos_token_id(loaded)
        self.model_runner = ModelRunner(config, loaded, offline)
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.cache.block_size,
                                          enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.block_manager)
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler.stream_interval)
        self._structured_outputs = None  # StructuredOutputManager, made on the first constrained request
        self._compiling: list[Request] = []  # added requests whose grammar was still compiling
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, sched.max_model_len)
        self.num_generation_tokens = 0  # tokens sampled by every step so far
        self._num_failed_steps = 0  # steps in a row that failed outside the forward pass
        logger.info("engine ready: %s, %s on %s, %d KV blocks of %d tokens (%s), attention %s, "
                    "prefix caching %s", config.model, self.model_runner.dtype, self.model_runner.device,
                    self.block_manager.num_blocks, self.block_manager.block_size,
                    str(self.model_runner.kv_cache_dtype).removeprefix("torch."),
                    self.model_runner.backend, "on" if config.cache.enable_prefix_caching else "off")
        # the longest request the KV cache holds (its last sampled token needs no slot)
        longest = self.block_manager.num_blocks * self.block_manager.block_size + 1
        if longest < sched.max_model_len:  # vLLM refuses to start; here those requests get a clear 400
            logger.warning("the KV cache holds requests of up to %d tokens (prompt + max_tokens), fewer than "
                           "max_model_len (%d): longer ones get a 400 (context_length_exceeded); raise "
                           "kv_cache_memory_gb (or num_gpu_blocks) or lower max_model_len", longest,
                           sched.max_model_len)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Request:
        """Queue a request. A text prompt is tokenized here; ``AsyncLLM`` passes prompts
        already through ``process_prompt`` so that its step loop never tokenizes.

        Raises:
            ValueError: naming the field and limit, for an empty prompt, a token id outside
                the vocabulary (prompt, ``logit_bias``, ``stop_token_ids``), a prompt plus
                ``max_tokens`` over ``max_model_len``, more KV blocks than the pool, ``n``
                over ``max_num_seqs``, text or stop strings without a tokenizer, an invalid
                ``structured_outputs`` schema, regex or grammar (naming
                ``structured_outputs.<field>``), or a duplicate ``request_id``.
        """
        params = sampling_params or SamplingParams()
        processed = self.process_prompt(prompt)
        text, token_ids = processed["prompt"], processed["prompt_token_ids"]
        self._check_params(params)
        max_len = self.config.scheduler.max_model_len
        max_tokens = params.max_tokens or max(1, max_len - len(token_ids))
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} "
                                      f"tokens max_model_len ({max_len}) leaves for output", "min_tokens")
        grammar = self._grammar(params)
        request = Request(request_id=request_id, prompt=text, prompt_token_ids=token_ids,
                          sampling_params=params, eos_token_id=self.eos_token_id,
                          max_tokens=max_tokens, grammar=grammar)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)
        if not request.is_ready:
            self._compiling.append(request)
        return request

    def _grammar(self, params: SamplingParams):
        """Sequence 0's matcher for ``params.structured_outputs`` (its compile submitted to
        the worker thread), ``None`` without a constraint."""
        if params.structured_outputs is None:
            return None
        if self._structured_outputs is None:
            if self.tokenizer is None:
                raise InvalidRequestError(f"structured_outputs: model {self.config.model!r} has no "
                                          "tokenizer to build a grammar over", "structured_outputs")
            from engine.structured_outputs import StructuredOutputManager  # imports xgrammar (~1 s)

            self._structured_outputs = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                               self.eos_token_id)
        return self._structured_outputs.grammar(params.structured_outputs)

    def process_prompt(self, prompt: PromptType) -> dict:
        """Tokenize and check a prompt: ``{"prompt": text or None, "prompt_token_ids": ids}``.

        Only reads the tokenizer and the config, so it may run on any thread (``AsyncLLM``
        runs it on a worker thread). Inputs that cannot fit are refused before the work that
        would prove it: text longer than ``max_prompt_chars`` before tokenizing, and token
        ids beyond ``max_model_len`` before checking each one.

        Raises:
            ContextLengthExceededError: the prompt cannot fit in ``max_model_len``.
            InvalidRequestError: naming ``prompt``, for text without a tokenizer, text that
                is not valid Unicode, a token id outside the vocabulary, or a prompt of
                another type.
        """
        if isinstance(prompt, dict):
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if token_ids is None:
                if text is None:
                    raise InvalidRequestError(f"prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'; got "
                                              f"{excerpt(prompt)}", "prompt")
                return self.process_prompt(text)
        elif isinstance(prompt, str):
            self._check_num_chars(len(prompt), "prompt")
            text, token_ids = prompt, self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, list(prompt)
        else:
            raise InvalidRequestError(f"prompt must be text, a list of token ids, or a dict with 'prompt' or "
                                      f"'prompt_token_ids'; got {excerpt(prompt)}", "prompt")
        self._check_num_tokens(len(token_ids))
        # ids the client sent are named by element (prompt[i]); ids of a text, not
        self._check_token_ids("prompt_token_ids" if text is None else "prompt", token_ids)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _check_num_chars(self, num_chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise ContextLengthExceededError(
                f"{param}: {num_chars} characters cannot fit in max_model_len "
                f"({self.config.scheduler.max_model_len}) tokens: this tokenizer's tokens cover "
                f"at most {self.max_prompt_chars} characters in all", param)

    def _check_num_tokens(self, num_tokens: int) -> None:
        # Cheaper than, and implied by, Scheduler.check_request: a prompt needs room for one
        # output token.
        max_len = self.config.scheduler.max_model_len
        if num_tokens >= max_len:
            raise ContextLengthExceededError(
                f"prompt ({num_tokens} tokens) + at least 1 output token exceeds max_model_len "
                f"({max_len})", "prompt")

    def _check_params(self, params: SamplingParams) -> None:
        self._check_token_ids("logit_bias", list(params.logit_bias))
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        if params.min_tokens > 0:  # what engine.sampler.apply_min_tokens forbids must leave a token
            forbidden = set(params.stop_token_ids)
            eos_held = self.eos_token_id is not None and not params.ignore_eos and params.structured_outputs is None
            if eos_held:
                forbidden.add(self.eos_token_id)
            vocab_size = self.model_config.vocab_size
            if len(forbidden) >= vocab_size:
                raise InvalidRequestError(
                    f"min_tokens: stop_token_ids{' and EOS' if eos_held else ''} cover all {vocab_size} token ids, "
                    f"so no token may come before min_tokens ({params.min_tokens})", "min_tokens")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(f"stop: model {self.config.model!r} has no tokenizer to "
                                      "match stop strings; use stop_token_ids", "stop")

    def _check_token_ids(self, field_name: str, token_ids: list) -> None:
        vocab_size = self.model_config.vocab_size
        bad = next(((i, t) for i, t in enumerate(token_ids) if not (isinstance(t, int) and 0 <= t < vocab_size)),
                   None)
        if bad is not None:
            index, token = bad
            param = "prompt" if field_name == "prompt_token_ids" else field_name  # the field a client sent
            if field_name not in ("logit_bias", "prompt"):  # a list it sent: name the element
                param += f"[{index}]"
            raise InvalidRequestError(f"{param}: token id {excerpt(token)} is outside the vocabulary "
                                      f"[0, {vocab_size})", param)

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None) -> dict:
        """A conversation through the tokenizer's chat template:
        ``{"prompt": text, "prompt_token_ids": ids}``. Thread-safe as ``process_prompt``; a
        conversation that cannot fit is refused before templating.

        Args:
            conversation: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: end with the template's opening of an assistant message.
            continue_final_message: leave the last message open (no end-of-turn token), so
                that the model continues it (vLLM's semantics: it excludes
                ``add_generation_prompt``).
            tools: function definitions (``name``, ``description``, ``parameters``) the
                model may call: rendered by the template if it takes ``tools``, else as
                Hermes-style instructions in the system message (``engine.tool_calls``).
                Messages may carry ``tool_calls`` (assistant) and be tool results.

        Raises:
            ContextLengthExceededError: naming ``messages``: more messages than
                ``max_model_len`` (each takes at least one token: its role marker), or more
                characters of content than ``max_prompt_chars``.
            InvalidRequestError: if the model has no chat template, if both flags are set,
                if the template cannot leave the last message open, or naming
                ``messages[i]`` for a message that is not a dict with a string ``role`` and a
                string or text-part ``content`` (``_template_messages``).
        """
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise InvalidRequestError(f"model {self.config.model!r} has no chat template", "messages")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both "
                                      "be true: set add_generation_prompt to false to continue the "
                                      "last message", "continue_final_message")
        conversation = _template_messages(conversation)
        max_len = self.config.scheduler.max_model_len
        if len(conversation) >= max_len:
            raise ContextLengthExceededError(
                f"messages: {len(conversation)} messages cannot fit in max_model_len ({max_len}) "
                "tokens (each message takes at least one)", "messages")
        self._check_num_chars(sum(len(m["content"]) for m in conversation
                                  if isinstance(m.get("content"), str)), "messages")
        if template_takes_tools(self.tokenizer.chat_template):
            conversation, options = conversation_for_template(conversation), {"tools": tools}
        else:
            conversation, options = conversation_with_tools(conversation, tools), {}
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, **options)
        except ValueError as exc:  # transformers: the last message cannot be left open
            raise InvalidRequestError(f"continue_final_message: {exc}", "continue_final_message") from None
        return self.process_prompt({"prompt": text,
                                    "prompt_token_ids": self.tokenize(text, add_special_tokens=False)})

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        Raises:
            InvalidRequestError: without a tokenizer, or for text that is not valid Unicode
                (a lone surrogate such as ``"\\udfff"`` has no UTF-8 encoding).
        """
        if self.tokenizer is None:
            raise InvalidRequestError(f"model {self.config.model!r} has no tokenizer: "
                                      "pass prompt_token_ids instead of text", "prompt")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(f"prompt: the text is not valid Unicode ({exc.reason} at "
                                      f"character {exc.start})", "prompt") from None
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop all sequences of a request and free their blocks.

        Returns:
            Its final output (finish_reason 'abort'), ``None`` if the request is unknown.
        """
        self._finish_requests([request_id], RequestStatus.FINISHED_ABORTED, error=None)
        # This request's output only: another's news (held back by stream_interval) waits
        # for the next step, which delivers it, or its error, to its own client.
        return next(iter(self._make_outputs([request_id])), None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, so that later requests recompute their prompts
        (e.g. between benchmark runs). Blocks that running requests hold stay theirs, no
        longer shareable. Always succeeds here (vLLM's returns False while requests run).

        Returns:
            True.
        """
        self.block_manager.reset_prefix_cache()
        return True

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and report what changed.

        A failure spares the engine where it can be confined (the step loop must outlive
        any one request; vLLM instead stops its engine core on any such exception):

        - an exception in the forward or the sampler fails the requests of this step only;
        - one while recording a sequence's token (its grammar, detokenizer, stop strings) or
          building a request's output fails that request only;
        - one elsewhere in the step (scheduling, the scheduler's bookkeeping) cannot be
          tied to a request: it fails every request in the engine. The engine then must hold
          no KV block and its block manager's invariants must hold, else the exception
          propagates, as it does when ``MAX_CONSECUTIVE_FAILED_STEPS`` steps in a row fail
          so (a fault that every request meets: the replica should be replaced, not answer
          every request with an error).

        A failed request finishes with ``finish_reason='abort'``, ``error`` set to
        ``"<exception type>: <message>"``, and its blocks freed.

        Returns:
            Outputs of the requests that produced a token or finished, in the form their
            ``SamplingParams.output_kind`` asks for.

        Raises:
            Exception: the step's own exception, as described above.
        """
        try:
            outputs = self._step()
        except Exception as exc:  # noqa: BLE001 - confined below, or re-raised
            return self._fail_all_requests(exc)
        self._num_failed_steps = 0
        return outputs

    def _step(self) -> list[RequestOutput]:
        self._check_compiles()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            if self._compiling:  # only grammars compiling: wait for one rather than spin
                self._compiling[0].grammar.wait(_COMPILE_POLL_S)
            return self._make_outputs()
        try:
            runner_output = self.model_runner.execute(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any one batch
            logger.exception("step failed; failing its %d sequences", len(scheduler_output.scheduled))
            request_ids = {self.scheduler.requests[s.seq_id].request_id
                           for s in scheduler_output.scheduled}
            self._finish_requests(request_ids, RequestStatus.FINISHED_ERROR, _describe(exc))
            return self._make_outputs()
        failed = set()
        for sequence, token in self.scheduler.update(scheduler_output, runner_output):
            if sequence.request_id in failed:
                continue
            try:
                self._record_token(sequence, token)
            except Exception as exc:  # noqa: BLE001 - one request's fault, not the step's
                logger.exception("request %s: recording sampled token %d failed; failing the request",
                                 sequence.request_id, token.token_id)
                failed.add(sequence.request_id)
                self._finish_requests([sequence.request_id], RequestStatus.FINISHED_ERROR, _describe(exc))
        return self._make_outputs()

    def _record_token(self, sequence: Request, token) -> None:
        """Check ``token`` against the sequence's grammar, detokenize it, apply stop strings."""
        if sequence.grammar is not None and not sequence.grammar.accept(token.token_id):
            if sequence.grammar.allows_no_token():  # the client's constraint, not a masking bug
                param = f"structured_outputs.{sequence.sampling_params.structured_outputs.kind}"
                self._fail_sequence(sequence, f"{param}: no text matches the constraint: it allows no token "
                                              f"after the {sequence.num_output_tokens - 1} generated", param)
            else:
                self._fail_sequence(sequence, f"structured_outputs: the grammar does not allow the "
                                              f"sampled token {token.token_id}")
        self.num_generation_tokens += 1
        stop = self.output_processor.add_token(sequence, token)
        if stop is not None:
            self._stop_at_string(sequence, stop)

    def _make_outputs(self, request_ids: Collection[str] | None = None) -> list[RequestOutput]:
        """``OutputProcessor.make_outputs``, and an error output for each request whose output
        could not be built (its sequences finished, blocks freed)."""
        outputs = self.output_processor.make_outputs(request_ids)
        for request_id, error in self.output_processor.pop_failed().items():
            self._finish_requests([request_id], RequestStatus.FINISHED_ERROR, error)
            output = self.output_processor.drop(request_id, error)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail_all_requests(self, exc: Exception) -> list[RequestOutput]:
        """Fail every request after a step raised ``exc`` outside the forward pass (see
        ``step``), or re-raise ``exc``."""
        self._num_failed_steps += 1
        if self._num_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            logger.error("%d steps in a row failed outside the forward pass: stopping", self._num_failed_steps)
            raise exc
        error = _describe(exc)
        request_ids = {r.request_id for r in self.scheduler.requests.values()} | set(self.output_processor.states)
        logger.exception("engine step failed; failing all %d requests", len(request_ids), exc_info=exc)
        try:
            for seq_id in list(self.scheduler.requests):
                self.scheduler.finish_request(seq_id, RequestStatus.FINISHED_ERROR)
            self._compiling = []
            outputs = [output for request_id in request_ids
                       if (output := self.output_processor.drop(request_id, error)) is not None]
            bm, sched = self.block_manager, self.scheduler
            if bm.num_free_blocks != bm.num_blocks or bm.block_tables:
                raise RuntimeError(f"{bm.num_blocks - bm.num_free_blocks} KV blocks still in use "
                                   "after failing every request")
            if sched.running or sched.waiting or self.output_processor.states:
                raise RuntimeError("requests still queued after failing every request")
            bm.check_invariants()
        except Exception as recovery:  # noqa: BLE001 - the engine's state is not trusted
            logger.error("recovery from the failed step failed: %s", _describe(recovery))
            raise exc from recovery
        return outputs

    def _check_compiles(self) -> None:
        """Forget requests whose grammar compile has finished; fail those where it failed."""
        still, left = [], False
        for request in self._compiling:
            if request.status.is_finished:
                left = True  # aborted while compiling
                continue
            if not request.is_ready:
                still.append(request)
            elif request.grammar.error is not None:
                self._finish_requests([request.request_id], RequestStatus.FINISHED_ERROR,
                                      request.grammar.error)
        if left:
            self._structured_outputs.cancel_unwanted({request.grammar.future for request in still})
        self._compiling = still

    def _fail_sequence(self, sequence: Request, error: str, param: str | None = None) -> None:
        """End ``sequence`` as failed: the engine's fault, or with ``param`` (the request field at
        fault) the request's own, a client error logged as one line."""
        (logger.info if param is not None else logger.error)("request %s: %s", sequence.request_id, error)
        if not sequence.status.is_finished:
            self.scheduler.finish_request(sequence.seq_id, RequestStatus.FINISHED_ERROR)
        sequence.error, sequence.error_param = error, param

    def _stop_at_string(self, sequence: Request, stop: str) -> None:
        """End a sequence whose new token completed the stop string ``stop``.

        A stop wins over the length limit: when the token that completed the string was also
        the ``max_tokens``-th, the scheduler has already finished the sequence as 'length'
        (and freed its blocks); it becomes 'stop' here. A sequence that a stop token or EOS
        ended keeps that token as its reason (vLLM checks stop strings only when no stop
        token ended the sequence)."""
        if sequence.status == RequestStatus.FINISHED_STOPPED:
            return
        sequence.stop_reason = stop
        if sequence.status == RequestStatus.FINISHED_LENGTH:
            sequence.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(sequence.seq_id, RequestStatus.FINISHED_STOPPED)

    def _finish_requests(self, request_ids, status: RequestStatus, error: str | None) -> None:
        """End every live sequence of the given requests, freeing their blocks."""
        for request_id in request_ids:
            for seq_id in self.output_processor.seq_ids(request_id):
                sequence = self.scheduler.finish_request(seq_id, status)
                if sequence is not None:
                    sequence.error = error
                    self.output_processor.mark_finished(sequence)

    # ---- introspection -------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters for tests, logs and metrics.

        ``num_free_blocks`` counts free blocks that still hold a cached prefix
        (``num_free_cached_blocks`` of them): they are evicted when taken.
        ``prefix_cache_queries`` and ``prefix_cache_hits`` are tokens: of the requests
        taken from the waiting queue (a preempted one is looked up again), and of those the
        ones found in the cache; ``prefix_cache_hit_rate`` is their ratio (0 before any).
        ``num_generation_tokens`` counts the tokens sampled since the engine started.
        ``num_cpu_threads`` is the intra-op thread count the last step ran with on a CPU
        (``engine.threads.FreeCpuThreads``: fewer while other processes use the CPUs), None
        on a GPU.
        """
        bm, sched = self.block_manager, self.scheduler
        total, free = bm.num_blocks, bm.num_free_blocks
        queries, hits = sched.prefix_cache_queries, sched.prefix_cache_hits
        return {
            "num_total_blocks": total,
            "num_free_blocks": free,
            "kv_cache_usage": (total - free) / total,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "num_cached_blocks": bm.num_cached_blocks,
            "num_free_cached_blocks": bm.num_free_cached_blocks,
            "num_generation_tokens": self.num_generation_tokens,
            "num_cpu_threads": self.model_runner.num_cpu_threads,
        }


def _describe(exc: BaseException) -> str:
    """A failed request's ``error``: the exception's type and message."""
    return f"{type(exc).__name__}: {exc}"


def _eos_token_id(loaded: LoadedModel) -> int | None:
    if loaded.tokenizer is not None and loaded.tokenizer.eos_token_id is not None:
        return loaded.tokenizer.eos_token_id
    eos = getattr(loaded.config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """The most characters of text that can tokenize into ``max_model_len`` tokens or
    fewer, ``None`` without a tokenizer.

    A token covers at most as many characters as its longest vocabulary string has: a
    byte-level BPE vocabulary (Llama 3, Qwen2, SmolLM2) spells one byte per character and a
    character takes at least one byte; a SentencePiece one spells ``▁`` for a space and
    ``<0xNN>`` (6 characters) for a single byte. A normalizer may merge up to
    ``_NORMALIZER_SHRINK`` characters into one first, so the bound is multiplied by that
    where the tokenizer has one. SmolLM2: 81 characters (a newline and 80 spaces) x 8192.
    """
    if tokenizer is None:
        return None
    longest = max(map(len, tokenizer.get_vocab()))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    shrink = _NORMALIZER_SHRINK if backend is None or backend.normalizer is not None else 1
    return max_model_len * longest * shrink


def _template_messages(conversation) -> list[dict]:
    """The conversation as the chat template takes it: content given as OpenAI's text parts
    (``[{"type": "text", "text": ...}]``) joined into one string, as the HTTP API joins them.

    Raises:
        InvalidRequestError: naming ``messages[i]`` for a message that is not a dict with a
            string ``role`` and a string or text-part ``content`` (an assistant's may be
            ``None``).
    """
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise InvalidRequestError(f"messages must be a list of at least one message; got {excerpt(conversation)}",
                                  "messages")
    messages = []
    for index, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{index}] must be a dict with a string 'role'; got "
                                      f"{excerpt(message)}", f"messages[{index}]")
        content = message.get("content")
        if isinstance(content, (list, tuple)) and content and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            message = {**message, "content": "".join(p["text"] for p in content)}
        elif not isinstance(content, str) and not (content is None and message["role"] == "assistant"):
            raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts "
                                      f"(None only for an assistant's); got {excerpt(content)}",
                                      f"messages[{index}].content")
        messages.append(message)
    return messages
