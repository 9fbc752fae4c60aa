"""Generation on the pipeline: prompts as micro-batches, one token a step, sampled on the last
stage and handed back to the first.

Each prompt is its own micro-batch (batch 1, no padding, so any model generates, and a
prompt's tokens do not depend on which prompts share the call). A rank walks its work in the
order (step t, virtual stage v, prompt j): stage v of prompt j at step t needs only stage
v - 1 of the same step, or the token of step t - 1, both earlier in that order, and every
link (activations forward, tokens back to the first stage) carries its messages in the order
both ends meet them, as NCCL requires. While the last stage samples prompt j, the first is
already at prompt j + 1: with at least as many prompts as stages the pipeline stays full.

Two paths:

- with a cache (every layer has `decode(x, cache, position)`: the built-in GPT, the
  Hugging Face families): the prompt once (the prefill), then one token a step; each layer
  keeps its keys and values in `cache`, a dict per (prompt, layer) that the layer fills;
  `position` is the index of `x`'s first token in the sequence.
- without (any model): the whole sequence every step, cropped to the model's
  `max_positions` where a layer declares one (learned positions), as nanoGPT's sampler does.

A finished prompt (an `eos` token) is passed down the pipeline once as an empty message
(`None`), so every stage stops working on it at the same step. Sampling draws from one
random stream a prompt, seeded by `(seed, prompt index)`: the same tokens on every grid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import Any, Callable, Iterable, Sequence

import torch
from mpi4py import MPI

from pipeflow import tree
from pipeflow.comm import waiting
from pipeflow.config import ConfigError
from pipeflow.layers import layer_seed
from pipeflow.runtime.recompute import run_layers
from pipeflow.runtime.tensor_parallel import VocabEmbedding, gather_vocab, whole_sequence

__all__ = ["Request", "normalise_prompts", "sample_next", "prompt_generator", "Decoding",
           "decodes", "layer_report", "choose_cache", "TAG", "VocabularyError", "vocabulary",
           "check_vocabulary"]

TAG = 16000      # generation's messages on the pipeline's links (the runner's tags are lower)


def normalise_prompts(prompt_ids: Any) -> tuple[tuple[int, ...], ...]:
    """Token ids of one prompt (a list of ints, a 1-D tensor) or several (a list of lists,
    a 2-D tensor, one row a prompt) as a tuple of prompts; a ValueError for anything else."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() not in (1, 2) or prompt_ids.is_floating_point():
            raise ValueError(f"prompt_ids: expected a 1-D or 2-D tensor of integer token ids, "
                             f"found {prompt_ids.dim()}-D {prompt_ids.dtype}")
        prompt_ids = prompt_ids.tolist()
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        raise ValueError(f"prompt_ids: expected token ids (a list of ints, or a list of such "
                         f"lists, one a prompt), found {_short(prompt_ids)}")
    rows = [prompt_ids] if all(_is_int(x) for x in prompt_ids) else list(prompt_ids)
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if not isinstance(row, (list, tuple)) or not row or \
                not all(_is_int(x) and x >= 0 for x in row):
            raise ValueError(f"prompt_ids: prompt {i} must be a non-empty list of token ids "
                             f"(integers >= 0), found {_short(row)}")
        out.append(tuple(int(x) for x in row))
    return tuple(out)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) < 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True)
class Request:
    """One `generate` call's arguments, checked; the same on every rank (`digest`)."""

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    eos: tuple[int, ...] = ()
    seed: int = 0
    use_cache: bool | None = None

    @staticmethod
    def make(prompt_ids: Any, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None,
             eos: int | Iterable[int] | None = None, seed: int = 0,
             use_cache: bool | None = None) -> "Request":
        """The checked request; a ValueError naming the argument and what it takes."""
        prompts = normalise_prompts(prompt_ids)
        _check(_is_int(max_new_tokens) and max_new_tokens >= 0, "max_new_tokens",
               "an integer >= 0", max_new_tokens)
        _check(isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
               and temperature >= 0, "temperature", "a number >= 0 (0: greedy)", temperature)
        _check(top_k is None or (_is_int(top_k) and top_k >= 1), "top_k",
               "None or an integer >= 1", top_k)
        _check(top_p is None or (isinstance(top_p, (int, float)) and 0 < top_p <= 1),
               "top_p", "None or a number in (0, 1]", top_p)
        stops = () if eos is None else ((eos,) if _is_int(eos) else tuple(eos))
        _check(all(_is_int(e) and e >= 0 for e in stops), "eos",
               "None, a token id or a list of token ids", eos)
        _check(_is_int(seed), "seed", "an integer", seed)
        _check(use_cache in (None, True, False), "use_cache", "None, True or False", use_cache)
        return Request(prompts, max_new_tokens, float(temperature), top_k,
                       None if top_p is None else float(top_p), tuple(sorted(set(stops))),
                       seed, use_cache)

    def digest(self) -> str:
        return hashlib.sha256(pickle.dumps(dataclasses.astuple(self))).hexdigest()

    def positions_needed(self) -> int:
        """The longest sequence any layer sees: a prompt and all but the last new token."""
        return max(len(p) for p in self.prompts) + max(self.max_new_tokens - 1, 0)


def _check(ok: bool, name: str, expected: str, found: Any) -> None:
    if not ok:
        raise ValueError(f"generate: {name} must be {expected}, found {found!r}")


def prompt_generator(seed: int, index: int) -> torch.Generator:
    """The random stream prompt `index` samples from: a function of `(seed, index)` only."""
    return torch.Generator().manual_seed(layer_seed(seed, index))


def sample_next(logits: torch.Tensor, request: Request, generator: torch.Generator) -> int:
    """The next token from one position's logits [V]: the arg-max at temperature 0, else a
    draw from softmax(logits / temperature) restricted to the `top_k` most likely tokens and
    to the smallest set whose probability reaches `top_p` (nucleus sampling)."""
    if request.temperature == 0:
        return int(torch.argmax(logits))
    # The largest score made 0 before dividing: with a tiny temperature (1e-320) the others
    # fall to -inf and the most likely token keeps probability 1, never inf - inf = NaN.
    scores = logits.detach().to("cpu", torch.float64)
    scores = (scores - scores.max()) / request.temperature
    if request.top_k is not None and request.top_k < scores.numel():
        kth = torch.topk(scores, request.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if request.top_p is not None and request.top_p < 1:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token once the more likely ones already reach top_p (the first one stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= request.top_p
        scores = scores.clone()
        scores[order[drop]] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class VocabularyError(ConfigError):
    """A prompt holds a token id the model's first layer has no row for."""


def vocabulary(stage: Any) -> int | None:
    """The model's vocabulary size, from the first `nn.Embedding` of layer 0 (its input
    embedding), on the rank that holds it; None elsewhere or where layer 0 has none."""
    for chunk, indices in zip(stage.chunk_layers, stage.plan.layer_ranges(stage.index)):
        for layer, i in zip(chunk, indices):
            if i == 0:
                embedding = next((m for m in layer.modules()
                                  if isinstance(m, torch.nn.Embedding)), None)
                if embedding is None:
                    return None
                # Cut along the vocabulary over the tensor group: this rank's rows of it.
                whole = stage.tensor.size if isinstance(embedding, VocabEmbedding) else 1
                return int(embedding.num_embeddings) * whole
    return None


def check_vocabulary(request: Request, vocab: int | None) -> None:
    """A VocabularyError naming the prompt, the id and the vocabulary where a prompt holds an
    id the model's embedding has no row for (torch's "index out of range in self" before)."""
    if vocab is None:
        return
    for i, prompt in enumerate(request.prompts):
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise VocabularyError(
                f"generate: prompt {i} holds token id {bad[0]}, outside the model's vocabulary "
                f"of {vocab} ids (0 to {vocab - 1}, the rows of layer 0's embedding); encode "
                f"the prompts with the model's own tokenizer")


def decodes(layer: torch.nn.Module) -> bool:
    """Whether `layer` keeps a cache: a `decode(x, cache, position)` method, not opted out
    by `decodes = False` (a Hugging Face family whose cached step pipeflow does not check)."""
    return callable(getattr(layer, "decode", None)) and getattr(layer, "decodes", True)


def layer_report(stage: Any) -> tuple[list[str], int | None]:
    """This rank's layers without a cache (named), and the fewest positions any of its
    layers holds (`max_positions`, None where none says)."""
    missing, limits = [], []
    for chunk, indices in zip(stage.chunk_layers, stage.plan.layer_ranges(stage.index)):
        for layer, i in zip(chunk, indices):
            if not decodes(layer):
                missing.append(f"layer {i} ({type(layer).__name__})")
            if isinstance(getattr(layer, "max_positions", None), int):
                limits.append(layer.max_positions)
    return missing, (min(limits) if limits else None)


def choose_cache(request: Request, missing: list[str], limit: int | None) -> bool:
    """Whether to decode with the cache (the same answer on every rank: the inputs are
    agreed): asked for, or by default where every layer has one and the text fits."""
    need = request.positions_needed()
    fits = limit is None or need <= limit
    if request.use_cache is True and missing:
        raise ValueError(f"generate(use_cache=True): {', '.join(missing[:4])} "
                         f"{'has' if len(missing) == 1 else 'have'} no decode(x, cache, "
                         f"position) method; use use_cache=None (or False) to recompute the "
                         f"whole sequence each step")
    if request.use_cache is True and not fits:
        raise ValueError(f"generate(use_cache=True): a prompt of "
                         f"{max(len(p) for p in request.prompts)} tokens and "
                         f"{request.max_new_tokens} new ones need {need} positions, the model "
                         f"has {limit}; ask for fewer tokens, or use use_cache=None (or False) "
                         f"to crop the context to the last {limit} tokens")
    if request.use_cache is not None:
        return request.use_cache
    return not missing and fits


class Decoding:
    """One rank's share of one `generate` call on its replica's pipeline.

    `stage`: the rank's `runtime.stage.Stage` (its layers, plan, communicators, device);
    `indices`: the global indices of the prompts this replica generates, its micro-batches
    in order; `on_item(text)`: called before each piece of work (the watchdog's beat).
    """

    def __init__(self, stage: Any, request: Request, indices: Sequence[int], cached: bool,
                 limit: int | None, on_item: Callable[[str], None]) -> None:
        self.stage, self.request, self.cached, self.limit = stage, request, cached, limit
        self.indices = list(indices)
        self.on_item = on_item
        plan = stage.plan
        self.last = plan.last_virtual
        self.first_rank, self.last_rank = plan.owner(0)[0], plan.owner(self.last)[0]
        self.mine = sorted((v, c) for c, v in enumerate(plan.programs.layout[stage.index]))
        n = len(self.indices)
        self.sequences = [list(request.prompts[i]) for i in self.indices]
        self.results: dict[int, list[int]] = {i: [] for i in self.indices}
        self.generators = [prompt_generator(request.seed, i) for i in self.indices]
        self.done: dict[int, set[int]] = {v: set() for v, _ in self.mine}
        self.caches: list[dict[int, dict]] = [{} for _ in range(n)]
        self.local: dict[tuple[int, int], Any] = {}       # (virtual stage, prompt) -> input
        self.local_tokens: dict[int, int | None] = {}
        self.announced: dict[int, Any] = {}
        self.heard: dict[int, Any] = {}
        self.sends: list[Any] = []
        self.token_sends: list[MPI.Request] = []
        self.tokens: MPI.Comm | None = None

    def run(self) -> dict[int, list[int]]:
        """Generate; this replica's new tokens by prompt index (on the last stage's rank;
        elsewhere the lists stay empty). Collective over the replica's pipeline."""
        self.tokens = self.stage.topo.pipe.Dup()   # tokens back: a link NCCL may lack
        try:
            with whole_sequence(self.stage.tensor):  # decoding cuts no sequence
                self._tokens()
        finally:
            self.tokens.Free()
        return self.results

    def _tokens(self) -> None:
        for t in range(self.request.max_new_tokens):
            for v, chunk in self.mine:
                for j in range(len(self.indices)):
                    if j not in self.done[v]:
                        self.on_item(f"generate: token {t} of prompt {self.indices[j]} "
                                     f"on virtual stage {v}")
                        self._item(t, v, chunk, j)
                self.sends = [s for s in self.sends if not s.test()]
        for s in self.sends:
            s.wait()
        waiting.waitall(self.token_sends)

    def _item(self, t: int, v: int, chunk: int, j: int) -> None:
        x = self._first_input(t, j) if v == 0 else self._receive(v, j)
        if x is None:                 # the prompt finished: stop here, tell the next stage
            self.done[v].add(j)
            self.caches[j].clear()
            if v != self.last:
                self._send(None, v, j)
            return
        position = 0 if t == 0 or not self.cached else len(self.request.prompts[
            self.indices[j]]) + t - 1
        y = self._forward(chunk, j, x, position)
        if v == self.last:
            self._sample(t, j, y)
        else:
            self._send(y, v, j)

    def _first_input(self, t: int, j: int) -> torch.Tensor | None:
        """The first stage's input: the prompt, then (cached) the last token or the whole
        sequence so far; None once the prompt has finished."""
        if t > 0:
            token = self._receive_token(j)
            if token is None:
                return None
            self.sequences[j].append(token)
        seq = self.sequences[j]
        if t > 0 and self.cached:
            ids = seq[-1:]
        else:
            ids = seq[-self.limit:] if self.limit is not None else seq
        return torch.tensor([ids], dtype=torch.long, device=self.stage.device)

    def _forward(self, chunk: int, j: int, x: Any, position: int) -> Any:
        stage = self.stage
        layers = stage.chunk_layers[chunk]
        if stage.plan.programs.layout[stage.index][chunk] == 0:
            x = stage.precision.cast_input(x)
        if not self.cached:
            return run_layers(layers, x)
        caches = self.caches[j]
        for layer, i in zip(layers, stage.plan.layer_ranges(stage.index)[chunk]):
            x = layer.decode(x, caches.setdefault(i, {}), position)
        return x

    def _sample(self, t: int, j: int, logits: Any) -> None:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(f"generate: the last layer must return logits [batch, positions, "
                             f"vocabulary], found {tree.describe(tree.header_of(logits)[0].metas)}")
        if self.stage.vocab_logits:     # cut along the vocabulary: sampled whole
            logits = gather_vocab(logits, self.stage.tensor)
        token = sample_next(logits[0, -1], self.request, self.generators[j])
        self.results[self.indices[j]].append(token)
        if t == self.request.max_new_tokens - 1:
            return                    # no step follows: nobody waits for this token
        self._send_token(None if token in self.request.eos else token, j)

    # -- messages ---------------------------------------------------------------------------
    def _send(self, x: Any, v: int, j: int) -> None:
        dest = self.stage.plan.owner(v + 1)[0]
        if dest == self.stage.index:
            self.local[(v + 1, j)] = x
            return
        comm = self.stage.pipe_comm
        header, ts = tree.header_of(x)
        # A message without tensors (the finished marker) always carries its header: with
        # neither, nothing would travel, and the receiver's probe would wait for it.
        announce = comm.always_header or not ts or self.announced.get(dest) != header
        self.announced[dest] = header
        self.sends.append(comm.send_message(header if announce else None, ts, dest, TAG))

    def _receive(self, v: int, j: int) -> Any:
        source = self.stage.plan.owner(v - 1)[0]
        if source == self.stage.index:
            return self.local.pop((v, j))
        comm = self.stage.pipe_comm
        known = None if comm.always_header else self.heard.get(source)
        header, ts = comm.recv_message(source, TAG, known, self.stage.device)
        self.heard[source] = header
        return header.rebuild(ts)

    def _send_token(self, token: int | None, j: int) -> None:
        if self.first_rank == self.stage.index:
            self.local_tokens[j] = token
        else:
            self.token_sends.append(self.tokens.isend(token, dest=self.first_rank, tag=0))

    def _receive_token(self, j: int) -> int | None:
        if self.last_rank == self.stage.index:
            return self.local_tokens.pop(j)
        return waiting.recv_object(self.tokens, self.last_rank, 0)
