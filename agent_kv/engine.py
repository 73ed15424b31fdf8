"""The inference engine: chunked prefill and decode over a policy-managed KV store.

One decode step, top to bottom (architecture.md, "Data flow of one decode step"):
model forward on the new token(s) -> the store appends their keys/values and the attention
function folds the attention mass into the scores -> the last logits give the confidence `c`
-> the policy evicts down to this step's budget -> the next token is sampled from the logits.
Prefill runs the same path chunk by chunk, so eviction also happens between chunks and the
store never holds more than budget + one chunk + the pinned tokens. Only the last chunk of a
prompt gates the budget with its confidence; earlier chunks get the policy's no-signal budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from agent_kv.cache import StoreCache
from agent_kv.confidence import confidence
from agent_kv.errors import ConfigError
from agent_kv.policies import Policy
from agent_kv.sampling import SamplingParams, sample_next
from agent_kv.session import Session, StepRecord


@dataclass
class Generation:
    """A finished reply.

    Attributes:
        text: generated text up to (not including) the first stop string or end-of-turn token.
        raw_text: everything generated and fed to the cache (stop strings included, EOS not).
        token_ids: generated token ids (EOS included when it ended the reply).
        finish_reason: "stop" (EOS or stop string) or "length" (max_new_tokens reached).
        prompt_tokens: tokens prefilled for this reply.
        ttft_s: seconds from the start of the prefill to the first sampled token.
        decode_s: seconds spent after the first token.
    """

    text: str
    raw_text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    ttft_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated after the first one, per second of decode."""
        return (len(self.token_ids) - 1) / self.decode_s if self.decode_s > 0 else 0.0


class Engine:
    """Runs a causal LM over `Session`s whose KV stores a `Policy` manages.

    Args:
        model: a transformers causal LM loaded with `attn_implementation="agent_kv"`.
        tokenizer: its tokenizer.
        policy: the KV policy applied after every forward call.
        prefill_chunk: tokens per prefill forward call.

    Raises:
        ConfigError: `prefill_chunk` < 1.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, policy: Policy, prefill_chunk: int = 512):
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy
        self.prefill_chunk = prefill_chunk
        generation_config = getattr(model, "generation_config", None)
        candidates = [
            *_as_list(tokenizer.eos_token_id),
            *_as_list(model.config.eos_token_id),
            *_as_list(getattr(generation_config, "eos_token_id", None)),
        ]
        self.eos_ids = {int(e) for e in candidates if e is not None}

    def new_session(self) -> Session:
        """An empty session for this engine's model."""
        return Session.for_model(self.model)

    @torch.no_grad()
    def feed(self, session: Session, token_ids: list[int]) -> torch.Tensor:
        """Run `token_ids` through the model in chunks, applying the policy after each chunk.

        Returns:
            `[vocab]` float32 logits after the last token (also kept as `session.last_logits`).

        Raises:
            ValueError: `token_ids` is empty.
        """
        if not token_ids:
            raise ValueError("feed needs at least one token")
        store = session.store
        for start in range(0, len(token_ids), self.prefill_chunk):
            chunk = token_ids[start : start + self.prefill_chunk]
            last_chunk = start + self.prefill_chunk >= len(token_ids)
            logits = self._forward(session.cache, range(1), [chunk])[0]  # [vocab]
            conf = float(confidence(logits))
            # Inside a prompt the logits after a chunk boundary say nothing about the reply:
            # only the last chunk's confidence gates the budget (None = no signal).
            gate = conf if last_chunk else None
            appended = store.nbytes()
            evicted = self.policy.step(store, gate)
            session.steps.append(
                StepRecord(
                    seen_tokens=store.seen_tokens,
                    appended_kv_bytes=appended,
                    kv_bytes=store.nbytes(),
                    confidence=conf,
                    gated=last_chunk,
                    budget=self.policy.budget(gate),
                    evicted=evicted,
                )
            )
            session.last_logits = logits
        session.token_ids.extend(token_ids)
        return session.last_logits

    def _forward(self, cache: StoreCache, rows: range, chunks: list[list[int]]) -> torch.Tensor:
        """One model call: `chunks[i]` (equal lengths) for row `rows[i]` of the cache's store;
        returns `[len(rows), vocab]` float32 logits after each row's last token."""
        store = cache.store
        position_ids = store.begin_forward(rows, len(chunks[0]))  # [rows, n]
        out = self.model(
            input_ids=torch.tensor(chunks, device=position_ids.device),
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            kv_store=store,
        )
        return out.logits[:, -1].float()

    def generate(
        self, session: Session, prompt_ids: list[int], params: SamplingParams
    ) -> Generation:
        """Prefill `prompt_ids`, then decode a reply.

        Every generated token except a final EOS is fed to the cache, so the cache ends with
        the prompt followed by `raw_text`.

        Raises:
            ConfigError: invalid sampling parameters.
            ValueError: empty prompt on an empty session.
        """
        params.validate()
        start = time.perf_counter()
        if prompt_ids:
            self.feed(session, prompt_ids)
        elif session.last_logits is None:
            raise ValueError("nothing to generate from: the session is empty and the prompt too")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(params.seed)
        generated: list[int] = []
        first_token_at = None
        finish = "length"
        for _ in range(params.max_new_tokens):
            token = sample_next(session.last_logits, params, generator)
            if first_token_at is None:
                first_token_at = time.perf_counter()
            generated.append(token)
            if token in self.eos_ids:
                finish = "stop"
                break
            self.feed(session, [token])
            text = self.tokenizer.decode(generated, skip_special_tokens=False)
            if any(s in text for s in params.stop):
                finish = "stop"
                break
        end = time.perf_counter()
        raw_ids = [t for t in generated if t not in self.eos_ids]
        raw_text = self.tokenizer.decode(raw_ids, skip_special_tokens=False)
        cut = min((raw_text.find(s) for s in params.stop if s in raw_text), default=len(raw_text))
        return Generation(
            text=raw_text[:cut],
            raw_text=raw_text,
            token_ids=generated,
            finish_reason=finish,
            prompt_tokens=len(prompt_ids),
            ttft_s=first_token_at - start,
            decode_s=end - first_token_at,
        )


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]
