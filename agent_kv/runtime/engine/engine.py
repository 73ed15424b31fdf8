"""The inference engine: chunked prefill and decode over a policy-managed KV store.

A reply, top to bottom (`Engine.generate`): `prefill` runs the prompt chunk by chunk, then
`decode_one_token` runs once per sampled token until the reply ends. Both are `step`, the one
forward step of the engine, over one sequence: a prefill chunk or a decode token through the
model (one graph per decode step with `compile`: `DecodeGraph` wraps the same call) -> the
store appends its keys/values and the call's measurements are folded into the policy's
statistics -> the last logits give the confidence `c` -> the policy evicts down to this
call's budget (docs/architecture.md, "Data flow of one forward call"); `generate` then samples
the next token from the logits. Eviction happens between prefill chunks too, so the store
never holds more than budget + one chunk + the pinned tokens. Only the last chunk of a prompt
gates the budget with its confidence; earlier chunks get the policy's no-signal budget. The
batch scheduler's iteration is the same `step` over many sequences, their tokens packed into
one call. (`decode` and `generate_batch` are the older path over the rows of one batched
store.)

The forward call and the policy's eviction after it are `agent_kv.runtime.engine.call_runner`
(`CallRunner`, which `Engine` extends); prefix sharing is `agent_kv.runtime.engine.prefix_sharing`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import cached_property

import torch

from agent_kv.errors import AgentKVError, ConfigError, ContextOverflowError
from agent_kv.kv.cache import PackedCache, StoreCache
from agent_kv.kv.forward_call import ForwardCall
from agent_kv.kv.packed_call import PackedCall
from agent_kv.kv.policies import ColdRecall, Policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.kv.store import BLOCK_TOKENS, Int8Config, KVStore
from agent_kv.kv.store.pins import flag_runs
from agent_kv.runtime.engine.batched_calls import BatchGeneration, PackedPart
from agent_kv.runtime.engine.call_runner import CallRunner, check_cancel
from agent_kv.runtime.engine.chat_engine import ChatEngine
from agent_kv.runtime.engine.decode_graph import DecodeGraph
from agent_kv.runtime.engine.model_call import run_call
from agent_kv.runtime.engine.policy_setup import check_store_options, policy_from_spec
from agent_kv.runtime.engine.prefix_sharing import (
    common_blocks,
    prefix_cache_for,
    publish_shared,
    read_shared,
    share_computed,
)
from agent_kv.runtime.engine.sequence import CallRecord, SequenceState
from agent_kv.runtime.replies.decoding import Generation, ReplyDecoder
from agent_kv.runtime.replies.grammar import GrammarCompiler, GrammarMatcher, end_of_generation_ids
from agent_kv.runtime.replies.sampling import SamplingParams


class Engine(CallRunner, ChatEngine):
    """Runs a causal LM over `SequenceState`s whose KV stores a `Policy` manages.

    Args:
        model: a transformers causal LM loaded with `attn_implementation="agent_kv"`.
        tokenizer: its tokenizer.
        policy: the KV policy applied after every forward call.
        prefill_chunk: tokens per prefill forward call.
        int8: mixed-precision storage (CONF-KV §4), or None to keep every token in the
            model's dtype.
        rerotate: StreamingLLM-style in-cache positions instead of original positions.
        compile: run decode steps as one graph each (`agent_kv.runtime.engine.decode_graph`:
            compiled on CPU, a CUDA graph on GPU); False runs every step eagerly.
        share_prefixes: hold the pinned token runs that sequences start with alike once, in
            blocks shared by every sequence of this engine (`agent_kv.kv.prefix_cache`,
            `share_prefix`); not with rerotate or sliding-window layers, where keys are not a
            function of their position and history alone or pins do not last.
        reencode: before feeding a prompt of more than one token (a new message, not a
            decoded token), encode the kept tokens again without the evicted history
            (`reencode`) once the cache has evicted, since the last time, as many tokens as
            it holds (summed over layers): its kept keys and values were then computed with a
            history more than half of which it no longer holds.

    Raises:
        ConfigError: `prefill_chunk` < 1, invalid `int8` settings, `rerotate` on a model
            without rotary embeddings, or `reencode` with a policy that keeps a cold tier or
            with `share_prefixes`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        policy: Policy,
        prefill_chunk: int = 512,
        int8: Int8Config | None = None,
        *,
        rerotate: bool = False,
        compile: bool = False,
        share_prefixes: bool = False,
        reencode: bool = False,
    ):
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        check_store_options(model, policy, int8, rerotate)
        if reencode and isinstance(policy, ColdRecall):
            raise ConfigError(
                "re-encoding starts a fresh cache without the cold tier that recall reads"
            )
        if reencode and share_prefixes:
            raise ConfigError("re-encoding starts a fresh cache that reads no shared prefix")
        graph = DecodeGraph(model) if compile else None
        super().__init__(model, tokenizer, policy, prefill_chunk, graph, int8 is not None)
        self.store_options = {"int8": int8, "rerotate": rerotate}
        self.prefix_cache = prefix_cache_for(model, rerotate) if share_prefixes else None
        """The shared prefix blocks of this engine's sequences (`share_prefixes`), or None."""
        self.reencodes = reencode
        """Whether new messages are preceded by `reencode` when due (the `reencode` arg)."""
        generation_config = getattr(model, "generation_config", None)
        candidates = [
            *_as_list(tokenizer.eos_token_id),
            *_as_list(model.config.eos_token_id),
            *_as_list(getattr(generation_config, "eos_token_id", None)),
            *end_of_generation_ids(tokenizer),
        ]
        self.eos_ids = {int(e) for e in candidates if e is not None}

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Builds `SamplingParams.grammar`s against this engine's tokenizer (made on first
        use; the tokenizer's EOS, or else the lowest end-of-turn id, ends a reply)."""
        eos = self.tokenizer.eos_token_id
        eos = min(self.eos_ids) if eos is None else eos
        return GrammarCompiler(self.tokenizer, self.model.config.vocab_size, eos, self.eos_ids)

    def matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A matcher for `params.grammar` (None without one)."""
        return None if params.grammar is None else self.grammars.matcher(params.grammar)

    @classmethod
    def from_spec(
        cls,
        spec: PolicySpec,
        model: torch.nn.Module,
        tokenizer,
        prefill_chunk: int = 512,
        compile: bool = False,
        share_prefixes: bool = False,
    ) -> Engine:
        """An engine for `model` with the policy and store options of `spec` (a byte budget
        becomes tokens at this model's FP cost per token and, with INT8, its INT8 cost; a
        `+reencode` spec sets `reencode`); `compile` and `share_prefixes` as in `Engine`.

        Raises:
            ConfigError: the budget holds no token, or invalid policy or engine settings.
        """
        return cls(
            model,
            tokenizer,
            policy_from_spec(spec, model),
            prefill_chunk,
            spec.int8,
            rerotate=spec.rerotate,
            compile=compile,
            share_prefixes=share_prefixes,
            reencode=spec.reencode,
        )

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile the decode graph now (`compile`; a minute or two on a 2-core CPU the first
        time, seconds once inductor's cache holds it) on scratch sequences, so that no request
        waits for it: one sequence of its own tokens, then two whose pinned openings of
        different lengths they read as shared prefix blocks (`share_prefixes`: a store the
        graph is traced for apart), after which the graph is compiled with dynamic shapes
        and serves every later session (`agent_kv.runtime.engine.decode_graph`). Nothing without
        `compile`."""
        if self.decode_graph is None:
            return
        for blocks in range(3):
            pinned = blocks * BLOCK_TOKENS
            sequence = self.new_sequence()
            sequence.store.pins.pin(0, pinned)
            self.prefill(sequence, [blocks] * (pinned + 8))  # no two openings alike
            self.publish_prefix(sequence)
            for _ in range(2):
                self.decode_one_token(sequence, 0)

    def new_sequence(self) -> SequenceState:
        """An empty sequence for this engine's model and store options."""
        return SequenceState.for_model(self.model, **self.store_options)

    def share_prefix(self, sequence: SequenceState, token_ids: list[int]) -> int:
        """Before `token_ids` are fed to a sequence that holds no token of its own yet: read
        the longest run of their leading whole blocks that is pinned and that the prefix cache
        holds from its shared blocks instead of computing it (never the last token, whose
        logits the prefill needs). The sequence moves past the tokens read. Returns how many.
        0 without `share_prefixes`, for a store of several rows or one with tokens of its
        own."""
        return read_shared(self.prefix_cache, sequence, token_ids)

    def publish_prefix(self, sequence: SequenceState) -> int:
        """After a sequence's prompt was fed: the whole blocks of the pinned run its own
        tokens start with go to the prefix cache (or are found there) and the sequence reads
        them shared from then on. Returns the tokens shared; 0 without `share_prefixes`."""
        return publish_shared(self.prefix_cache, sequence)

    def _share_batch_prefix(self, store: KVStore, prompts: list[list[int]]) -> int:
        """With `share_prefixes`: the prompts' longest common prefix, in whole blocks and
        before every prompt's last token (whose logits each row needs), computed once on a
        one-row sequence that pins it and publishes it to the prefix cache (or found there,
        `prefill`), then read by every row of the batch's empty `store` as shared blocks. Returns
        the tokens each row reads shared (0 without `share_prefixes`, with rerotate, or
        without one whole common block)."""
        count = common_blocks(self.prefix_cache, store, prompts)
        if not count:
            return 0
        prefix = self.new_sequence()
        prefix.store.pins.pin(0, count)
        self.prefill(prefix, prompts[0][:count])
        return share_computed(self.prefix_cache, store, prefix.store, count)

    @torch.no_grad()
    def prefill(
        self, sequence: SequenceState, token_ids: list[int], cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """Run `token_ids` through the model in chunks, applying the policy after each chunk.

        Returns:
            `[vocab]` float32 logits after the last token (also kept as `sequence.last_logits`).

        With `reencode` on, a prompt of more than one token is preceded by `reencode` when
        it is due (the `Engine` argument).

        Raises:
            ValueError: `token_ids` is empty.
            ContextOverflowError: the tokens would pass the model's trained context (checked
                before any compute with original positions; with rerotate, when the policy
                keeps too much, after the chunks that fitted were fed).
            TurnCancelled: `cancel` was set before a chunk; the sequence holds the chunks fed
                before it.
        """
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        if self.reencodes and len(token_ids) > 1 and _reencode_due(sequence):
            self.reencode(sequence)
        store = sequence.store
        if store.positions_mode == "original":
            store.check_context(store.seen_tokens + len(token_ids))
        shared = self.share_prefix(sequence, token_ids)
        self._prefill_steps(sequence, token_ids[shared:], cancel)
        self.publish_prefix(sequence)
        return sequence.last_logits

    def _prefill_steps(
        self, sequence: SequenceState, token_ids: list[int], cancel: threading.Event | None = None
    ) -> None:
        """`token_ids` through `step`, `prefill_chunk` tokens a step, under the engine's
        policy, only the last chunk gated by its confidence. Raises `TurnCancelled` when
        `cancel` is set before a chunk, and a chunk's `ContextOverflowError` (the chunks
        before it fed)."""
        chunk = self.prefill_chunk
        for start in range(0, len(token_ids), chunk):
            check_cancel(cancel)
            piece, last = token_ids[start : start + chunk], start + chunk >= len(token_ids)
            self._step_one(PackedPart(sequence, piece, self.policy, last))

    @torch.no_grad()
    def decode_one_token(self, sequence: SequenceState, token: int) -> torch.Tensor:
        """One decode step of one sequence: `step` on `token` (the compiled graph with
        `compile`), the policy's eviction gated by its confidence, a `CallRecord` in
        `sequence.steps`.

        Returns:
            `[vocab]` float32 logits after `token` (also kept as `sequence.last_logits`).

        Raises:
            ContextOverflowError: the token would pass the model's trained context.
        """
        logits = self._step_one(PackedPart(sequence, [token], self.policy, True))
        self.publish_prefix(sequence)
        return logits

    def _step_one(self, part: PackedPart) -> torch.Tensor:
        """`step` over one sequence; its logits, or its error raised."""
        (result,) = self.step([part])
        if isinstance(result, Exception):
            raise result
        return result

    @torch.no_grad()
    def reencode(self, sequence: SequenceState) -> int:
        """Encode the tokens the sequence's cache keeps again, alone, in a fresh cache: every
        position that some layer still holds (the union over layers), fed in order at its
        original position (rerotate: renumbered in order, as that mode places kept tokens),
        so that their keys and values no longer carry the history that was evicted. The
        policy then evicts after each call as in any prefill (a layer that held fewer tokens
        is evicted down to its budget again); pins, token ids, step records and figures carry
        over (peaks the larger, counters summed), and the old cache is let go first. Returns
        the tokens encoded again.

        Why: on a long agent history a cache that keeps an agent's note (pinned) and the
        latest page still answers from the latest page, while the same tokens encoded
        without the evicted pages answer from the note (docs/results/long-horizon/README.md,
        "Pinning the agent's notes does not bring the fact back").

        Raises:
            ValueError: a store of more than one row, or an empty sequence.
            ConfigError: the policy keeps a cold tier (a fresh cache would drop it).
        """
        old = sequence.store
        if old.batch != 1 or not sequence.token_ids:
            raise ValueError("reencode needs a one-row sequence that has seen tokens")
        if old.recall.tier is not None:
            raise ConfigError("re-encoding would drop the cold tier that recall reads")
        seen, pins, figures = old.seen_tokens, old.pins.flags.clone(), old.figures
        kept = torch.zeros(seen, dtype=torch.bool)  # [seen]: held by some layer
        for layer in range(old.num_layers):
            kept[old.live_positions(layer).cpu()] = True
        token_ids, steps = sequence.token_ids, sequence.steps
        del old
        sequence.restart(self.new_sequence)
        store = sequence.store
        store.pins.load(pins)
        store.figures.carry(figures)
        sequence.steps = steps
        for start, end in flag_runs(kept.tolist()):
            store.skip(start - store.seen_tokens)
            self._prefill_steps(sequence, token_ids[start:end])
        store.skip(seen - store.seen_tokens)
        sequence.token_ids = token_ids
        sequence.evicted_at_reencode = store.figures.evicted_tokens
        count = int(kept.sum())
        store.figures.reencoded_tokens += count
        return count

    @torch.no_grad()
    def decode(
        self,
        cache: StoreCache,
        tokens: list[int],
        records: list[list[CallRecord]] | None = None,
    ) -> torch.Tensor:
        """One decode step for every row of `cache`'s store: `tokens[i]` fed to row `i` in one
        model call (one graph, with `compile`), then the policy evicts in each row with the
        confidence of its own next-token distribution, appending a `CallRecord` to
        `records[i]` when given.

        Returns:
            float32 logits `[B, vocab]` after the step.
        """
        store = cache.store
        rows = range(store.batch)
        logits = self._forward(cache, rows, [[token] for token in tokens])
        records = [[] for _ in rows] if records is None else records
        self._apply_policy(store, rows, logits, [True] * store.batch, records)
        return logits

    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> BatchGeneration:
        """Decode replies to several prompts together, one row of a batched store each.

        Each prompt is prefilled on its own row (rows then differ in length); decoding runs
        every row in one model call per token, and each row gets its own confidence, budget
        and eviction. With `share_prefixes`, the prompts' longest common prefix in whole
        blocks is computed once and read by every row from shared blocks
        (`_share_batch_prefix`), never evicted. Rows are ragged: attention masks each row at
        its own length. A row that has finished (EOS, stop string) keeps being fed its last
        token until every row is done; its reply is fixed when it finishes. With a `seed`,
        every row samples from its own generator seeded alike, so a batch equals its prompts
        run one by one.

        Each row's reply is decoded by its own `ReplyDecoder`, as `generate` decodes one
        (sampling, end of the reply, text). With a grammar, each row has its own matcher and
        finishes when its grammar is complete.

        Raises:
            ConfigError: invalid sampling parameters; `GrammarError` (a `ConfigError`): a
                grammar that cannot be built.
            ValueError: no prompts, or an empty prompt.
        """
        params.validate()
        if not prompts or not all(prompts):
            raise ValueError("generate_batch needs at least one prompt, none of them empty")
        start = time.perf_counter()
        decoders = [
            ReplyDecoder(
                params,
                self.matcher(params),
                self.tokenizer,
                self.eos_ids,
                started=start,
                prompt_ids=prompt,
            )
            for prompt in prompts
        ]  # each with its own matcher and (with a seed) its own generator seeded alike
        store = KVStore.for_model(self.model, batch=len(prompts), **self.store_options)
        cache = StoreCache(store)
        steps: list[list[CallRecord]] = [[] for _ in prompts]
        shared = self._share_batch_prefix(store, prompts)
        logits = torch.stack(
            [self._prefill_row(cache, row, p[shared:], steps[row]) for row, p in enumerate(prompts)]
        )  # [B, vocab]
        while True:
            chosen = [decoder.choose(logits[row]) for row, decoder in enumerate(decoders)]
            running = [row for row, token in enumerate(chosen) if token is not None]
            if not running:
                break
            # a finished row is fed its last token (a row ends only after choosing one)
            feed = [decoders[row].generated[-1] if t is None else t for row, t in enumerate(chosen)]
            logits = self.decode(cache, feed, steps)
            for row in running:
                decoders[row].fed()
        generations = [d.generation(len(prompts[row])) for row, d in enumerate(decoders)]
        return BatchGeneration(generations=generations, store=store, steps=steps)

    @torch.no_grad()
    def score(self, sequence: SequenceState, token_ids: list[int], chunk: int = 16) -> torch.Tensor:
        """Teacher-forced log-likelihood of `token_ids` under the managed cache.

        The tokens are fed `chunk` at a time; after each call the policy evicts with the
        confidence of the call's last next-token distribution (gated, as in decode), so with
        `chunk=1` this is exactly decoding the text; larger chunks let the cache overshoot
        the budget by up to `chunk - 1` tokens between evictions.

        Returns:
            `[len(token_ids) - 1]` float32: `log p(token_ids[i] | everything before)` for
            `i >= 1` (the first token is conditioned on, not scored).

        Raises:
            ValueError: fewer than two tokens, or `chunk < 1`.
        """
        if len(token_ids) < 2 or chunk < 1:
            raise ValueError("score needs at least two tokens and chunk >= 1")
        log_probs = []
        for start in range(0, len(token_ids), chunk):
            piece = token_ids[start : start + chunk]
            logits = self._forward(sequence.cache, range(1), [piece], all_positions=True)[0]
            self._apply_policy(sequence.store, range(1), logits[-1:], [True], [sequence.steps])
            log_probs.append(torch.log_softmax(logits, dim=-1))  # [n, vocab]
            sequence.last_logits = logits[-1]
        sequence.token_ids.extend(token_ids)
        targets = torch.tensor(token_ids[1:])
        return torch.cat(log_probs)[:-1].gather(1, targets[:, None]).squeeze(1)

    @torch.no_grad()
    def step(self, parts: list[PackedPart]) -> list[torch.Tensor | AgentKVError]:
        """The engine's one forward step, over one sequence or several (continuous batching):
        each part's tokens (a decode token, or a prefill chunk of at most `prefill_chunk`
        tokens) through the model, then each part's policy evicts in its store, gated as
        `PackedPart.gated` says, and the sequence moves on (`token_ids`, `last_logits`, a
        `CallRecord`). One part runs alone (the decode graph with `compile`): `prefill` and
        `decode_one_token` are this step; several are packed into one row
        (`agent_kv.kv.packed_call`), each sequence read and written through its own store.

        Returns:
            per part, float32 logits `[vocab]` after its last token; or, for a part whose
            tokens would pass the model's context, the `ContextOverflowError` (that part is
            left out of the call and its sequence is unchanged).
        """
        results: list[torch.Tensor | AgentKVError | None] = [None] * len(parts)
        calls, running = [], []
        for i, part in enumerate(parts):
            store = part.sequence.store
            try:
                if len(parts) > 1:
                    plan = self._prepare(part.policy, store)
                    self._vote(part.sequence.cache, range(1), [part.tokens], plan)
                    calls.append(ForwardCall.open(store, range(1), len(part.tokens), plan))
                else:
                    store.check_context(store.next_position(0) + len(part.tokens))
            except ContextOverflowError as err:
                results[i] = err
                continue
            running.append(i)
        if not running:
            return results
        if len(parts) == 1:
            part = parts[0]
            logits = self._forward(part.sequence.cache, range(1), [part.tokens], policy=part.policy)
        else:
            packed = PackedCall(calls)
            input_ids = torch.tensor(
                [[t for i in running for t in parts[i].tokens]], device=self.model.device
            )
            cache = PackedCache(len(parts[0].sequence.cache.layers))
            logits = run_call(self.model, cache, packed, input_ids, packed.last_indices())
            logits = logits[0].float()  # [len(running), vocab]
        for k, i in enumerate(running):
            part, sequence = parts[i], parts[i].sequence
            self._after_chunk(
                part.policy, sequence.cache, 0, part.tokens, logits[k : k + 1], part.gated,
                sequence.steps,
            )  # fmt: skip
            sequence.token_ids.extend(part.tokens)
            sequence.last_logits = results[i] = logits[k]
        return results

    def generate(
        self,
        sequence: SequenceState,
        prompt_ids: list[int],
        params: SamplingParams,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Generation:
        """Prefill `prompt_ids`, then decode a reply.

        Every generated token except a final EOS is fed to the cache, so the cache ends with
        the prompt followed by `raw_text`. `on_text`, if given, receives the reply's text as
        it grows, in pieces that concatenate to `text`: a piece is held back while it could
        still be the start of a stop string or ends in an incomplete character.

        With `params.grammar`, each token is drawn from those the grammar allows and the
        reply ends once the grammar is complete (`finish_reason` "stop"); the grammar is
        built before anything is prefilled. The repetition penalty counts the sequence's
        tokens so far and `prompt_ids` as the prompt (the whole prompt, as vLLM does).

        Raises:
            ConfigError: invalid sampling parameters; `GrammarError` (a `ConfigError`): a
                grammar that cannot be built (nothing was prefilled).
            ValueError: empty prompt on an empty sequence.
            TurnCancelled: `cancel` was set before a prefill chunk or a decode step; the
                sequence keeps every token fed before it.
        """
        params.validate()
        decoder = ReplyDecoder(
            params, self.matcher(params), self.tokenizer, self.eos_ids, on_text,
            prompt_ids=[*sequence.token_ids, *prompt_ids],
        )  # fmt: skip
        logits = self.prefill(sequence, prompt_ids, cancel) if prompt_ids else sequence.last_logits
        if logits is None:
            raise ValueError("nothing to generate from: the session is empty and the prompt too")
        while (token := decoder.choose(logits)) is not None:
            check_cancel(cancel)
            logits = self.decode_one_token(sequence, token)
            decoder.fed()
        return decoder.generation(len(prompt_ids))


def _reencode_due(sequence: SequenceState) -> bool:
    """Whether the sequence's cache has evicted, since its kept tokens were last encoded again
    (or since it began), at least as many tokens as it holds now, both summed over layers."""
    store = sequence.store
    evicted = store.figures.evicted_tokens - sequence.evicted_at_reencode
    return evicted > 0 and evicted >= sum(store.lengths())


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]
