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
  keeps its keys and values in `cache`, a dict per (prompt, layer) that the layer fills,
  handed over holding `cache[POSITIONS]`, the positions to allocate for (`kv_cache`);
  `position` is the index of `x`'s first token in the sequence.
- without (any model): the whole sequence every step, cropped to the model's
  `max_positions` where a layer declares one (learned positions), as nanoGPT's sampler does.

What the host does per token, for a GPU's sake: the token is chosen on the device and read
only where it must travel (the hand-back to another rank) or an `eos` may stop the prompt; a
link's headers are agreed once a call per number of positions (`_send`), not sent per token.
Where an `eos` may stop a prompt early, the last stage hands each token to every rank of the
pipeline, not only the first, so every stage stops the prompt at the same step without a
message down the pipeline (which a receiver that cannot probe, NCCL's, could not expect).
With a tensor axis the last stage's ranks gather the last position's logits whole and choose
alike. Sampling draws from one random stream a prompt, seeded by `(seed, prompt index)`: the
same tokens on every grid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import Any, Callable, Iterable, Sequence

import torch
from mpi4py import MPI

from pipeflow import tree
from pipeflow.comm import ProtocolError, waiting
from pipeflow.config import ConfigError
from pipeflow.layers import layer_seed
from pipeflow.runtime.kv_cache import POSITIONS
from pipeflow.runtime.recompute import run_layers
from pipeflow.runtime.tensor_parallel import VocabEmbedding, gather_vocab, whole_sequence

__all__ = ["Request", "normalise_prompts", "sample_next", "choose_token", "prompt_generator",
           "Decoding", "decodes", "layer_report", "choose_cache", "TAG", "VocabularyError",
           "vocabulary", "check_vocabulary"]

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

    def positions_needed(self, prompt: int | None = None) -> int:
        """The longest sequence any layer sees (of prompt `prompt`, or of any): a prompt
        and all but the last new token."""
        lengths = [len(p) for p in self.prompts] if prompt is None \
            else [len(self.prompts[prompt])]
        return max(lengths) + max(self.max_new_tokens - 1, 0)


def _check(ok: bool, name: str, expected: str, found: Any) -> None:
    if not ok:
        raise ValueError(f"generate: {name} must be {expected}, found {found!r}")


def prompt_generator(seed: int, index: int) -> torch.Generator:
    """The random stream prompt `index` samples from: a function of `(seed, index)` only."""
    return torch.Generator().manual_seed(layer_seed(seed, index))


def sample_next(logits: torch.Tensor, request: Request, generator: torch.Generator) -> int:
    """`choose_token`'s token as an int."""
    return int(choose_token(logits, request, generator))


def choose_token(logits: torch.Tensor, request: Request,
                 generator: torch.Generator) -> torch.Tensor:
    """The next token from one position's logits [V], a 0-d tensor on their device (chosen
    without waiting for the device): the arg-max at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the `top_k` most likely tokens and to the
    smallest set whose probability reaches `top_p` (nucleus sampling)."""
    if request.temperature == 0:
        return torch.argmax(logits)
    # The largest score made 0 before dividing: with a tiny temperature (1e-320) the others
    # fall to -inf and the most likely token keeps probability 1, never inf - inf = NaN.
    scores = logits.detach().to(torch.float64)
    scores = (scores - scores.max()) / request.temperature
    if request.top_k is not None and request.top_k < scores.numel():
        kth = torch.topk(scores, request.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if request.top_p is not None and request.top_p < 1:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token once the more likely ones already reach top_p (the first one stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= request.top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop),
                                    float("-inf"))
    # Inverse transform sampling: the first token whose cumulative probability passes one
    # uniform draw of the prompt's stream (a CPU scalar, which a device op takes by value).
    cdf = torch.softmax(scores, dim=-1).cumsum(-1)
    draw = cdf[-1:] * torch.rand((), generator=generator, dtype=torch.float64)
    return torch.searchsorted(cdf, draw, right=True)[0].clamp(max=cdf.numel() - 1)


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

    # False: the layers' caches grow by concatenation, as before they were preallocated
    # (kept for benchmarks/bench_generate.py's side-by-side comparison).
    preallocate = True

    def __init__(self, stage: Any, request: Request, indices: Sequence[int], cached: bool,
                 limit: int | None, on_item: Callable[[str], None]) -> None:
        self.stage, self.request, self.cached, self.limit = stage, request, cached, limit
        self.indices = list(indices)
        self.on_item = on_item
        plan = stage.plan
        self.rank = stage.index
        self.last = plan.last_virtual
        self.first_rank, self.last_rank = plan.owner(0)[0], plan.owner(self.last)[0]
        self.mine = sorted((v, c) for c, v in enumerate(plan.programs.layout[stage.index]))
        n = len(self.indices)
        self.prompts = [request.prompts[i] for i in self.indices]
        self.results: dict[int, list[Any]] = {i: [] for i in self.indices}
        self.generators = [prompt_generator(request.seed, i) for i in self.indices]
        self.finished: set[int] = set()                   # prompts this rank stopped
        self.caches: list[dict[int, dict]] = [{} for _ in range(n)]
        self.ids: dict[int, torch.Tensor] = {}            # first stage: prompt + new tokens
        self.filled: dict[int, int] = {}                  # ... how many of them are known
        self.local: dict[tuple[int, int], Any] = {}       # (virtual stage, prompt) -> input
        self.local_tokens: dict[int, Any] = {}
        self.said: dict[tuple[int, int], Any] = {}        # (peer, positions) -> header
        self.heard: dict[tuple[int, int], Any] = {}
        self.sends: list[Any] = []
        self.token_sends: list[MPI.Request] = []
        self.tokens: MPI.Comm | None = None
        # Who hears each token from the last stage: the first stage (its next input) and,
        # where an eos may stop a prompt early, every rank of the pipeline, so each stops
        # it at the same step with no message down the pipeline.
        ranks = {plan.owner(v)[0] for v in range(self.last + 1)}
        self.hearers = sorted(r for r in ranks - {self.last_rank}
                              if r == self.first_rank or request.eos)

    def run(self) -> dict[int, list[int]]:
        """Generate; this replica's new tokens by prompt index (on the last stage's rank;
        elsewhere the lists stay empty). Collective over the replica's pipeline."""
        self.tokens = self.stage.topo.pipe.Dup()   # tokens back: a link NCCL may lack
        try:
            with whole_sequence(self.stage.tensor):  # decoding cuts no sequence
                self._tokens()
        finally:
            self.tokens.Free()
        return self._read_results()

    def _tokens(self) -> None:
        for t in range(self.request.max_new_tokens):
            for k, (v, chunk) in enumerate(self.mine):
                for j in range(len(self.indices)):
                    if t > 0 and k == 0 and j not in self.finished:
                        self._hear(j)
                    if j not in self.finished:
                        self.on_item(f"generate: token {t} of prompt {self.indices[j]} "
                                     f"on virtual stage {v}")
                        self._item(t, v, chunk, j)
                self.sends = [s for s in self.sends if not s.test()]
        for s in self.sends:
            s.wait()
        waiting.waitall(self.token_sends)

    def _positions(self, t: int, j: int) -> int:
        """How many positions step `t` of prompt `j` feeds the model (the same on every rank:
        what a link's messages of that step are agreed by)."""
        if t > 0 and self.cached:
            return 1
        seen = len(self.prompts[j]) + t
        return min(seen, self.limit) if self.limit is not None else seen

    def _item(self, t: int, v: int, chunk: int, j: int) -> None:
        positions = self._positions(t, j)
        x = self._first_input(t, j, positions) if v == 0 else self._receive(v, j, positions)
        position = 0 if t == 0 or not self.cached else len(self.prompts[j]) + t - 1
        y = self._forward(chunk, j, x, position)
        if v == self.last:
            self._sample(t, j, y)
        else:
            self._send(y, v, j, positions)

    def _first_input(self, t: int, j: int, positions: int) -> torch.Tensor:
        """The first stage's input: the prompt, then (cached) the last token or the last
        `positions` of the sequence so far, a view of the prompt's ids on the device."""
        if t == 0:
            prompt = self.prompts[j]
            ids = self.ids[j] = torch.empty(1, len(prompt) + self.request.max_new_tokens,
                                            dtype=torch.long, device=self.stage.device)
            ids[0, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            self.filled[j] = len(prompt)
        end = self.filled[j]
        return self.ids[j][:, end - positions:end]

    def _forward(self, chunk: int, j: int, x: Any, position: int) -> Any:
        stage = self.stage
        layers = stage.chunk_layers[chunk]
        if stage.plan.programs.layout[stage.index][chunk] == 0:
            x = stage.precision.cast_input(x)
        if not self.cached:
            return run_layers(layers, x)
        caches = self.caches[j]
        for layer, i in zip(layers, stage.plan.layer_ranges(stage.index)[chunk]):
            x = layer.decode(x, caches.setdefault(i, self._new_cache(j)), position)
        return x

    def _new_cache(self, j: int) -> dict:
        """A layer's cache for prompt `j`: told how many positions it will hold."""
        if not self.preallocate:
            return {}
        return {POSITIONS: self.request.positions_needed(self.indices[j])}

    def _sample(self, t: int, j: int, logits: Any) -> None:
        """The last stage: prompt `j`'s token of step `t`, handed back. It stays on the
        device (no wait) where nobody needs its value before the call ends; it is read where
        it travels to another rank (the hand-back) or an eos may stop the prompt."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(f"generate: the last layer must return logits [batch, positions, "
                             f"vocabulary], found {tree.describe(tree.header_of(logits)[0].metas)}")
        row = logits[:, -1:]
        if self.stage.vocab_logits:     # cut along the vocabulary: the last position whole,
            row = gather_vocab(row, self.stage.tensor)   # alike on every tensor rank
        token: Any = choose_token(row[0, -1], self.request, self.generators[j])
        final = t == self.request.max_new_tokens - 1
        if not final and (self.request.eos or self.hearers):
            token = int(token)                           # the hand-back's one host read
        self.results[self.indices[j]].append(token)
        if final:
            return                    # no step follows: nobody waits for this token
        stop = bool(self.request.eos) and token in self.request.eos
        if stop:
            self._finish(j)
        elif self.first_rank == self.rank:
            self.local_tokens[j] = token
        for r in self.hearers:
            self.token_sends.append(self.tokens.isend(None if stop else token, dest=r, tag=0))

    def _hear(self, j: int) -> None:
        """Before prompt `j`'s first work of a step: the token the last stage chose in the
        step before, where this rank needs it (the first stage's next input; elsewhere
        whether an eos stopped the prompt)."""
        if self.rank == self.last_rank:
            token = self.local_tokens.pop(j, None)   # here only where also the first
        elif self.rank in self.hearers:
            token = waiting.recv_object(self.tokens, self.last_rank, 0)
            if token is None:
                self._finish(j)
                return
        else:
            return
        if self.rank == self.first_rank:
            self.ids[j][0, self.filled[j]] = token
            self.filled[j] += 1

    def _finish(self, j: int) -> None:
        self.finished.add(j)
        self.caches[j].clear()

    def _read_results(self) -> dict[int, list[int]]:
        """The tokens as ints: those left on the device read in one go."""
        waiting_tokens = [tok for toks in self.results.values() for tok in toks
                          if isinstance(tok, torch.Tensor)]
        if not waiting_tokens:
            return self.results
        values = iter(torch.stack(waiting_tokens).tolist())
        return {i: [next(values) if isinstance(tok, torch.Tensor) else tok for tok in toks]
                for i, toks in self.results.items()}

    # -- messages ---------------------------------------------------------------------------
    # A link's header is agreed per number of positions a message carries (the prompt's
    # length for its first step, 1 for each cached step after): the first message of each
    # announces it, the rest send tensors alone, so a call exchanges a handful of headers, not
    # one a token. Both ends know the positions of every message (from the agreed request).
    def _send(self, x: Any, v: int, j: int, positions: int) -> None:
        dest = self.stage.plan.owner(v + 1)[0]
        if dest == self.rank:
            self.local[(v + 1, j)] = x
            return
        comm = self.stage.pipe_comm
        header, ts = tree.header_of(x)
        known = _known(self.said.get((dest, positions)))
        if known is not None and header != known and comm.always_header:
            raise ProtocolError(
                f"generate: pipeline stage {self.rank} sends virtual stage {v + 1} "
                f"{tree.describe(header.metas)} for {positions} position(s), where the call's "
                f"first such message agreed {tree.describe(known.metas)}: where a receiver "
                f"cannot probe a message (torch.distributed, NCCL's rules) a decode step's "
                f"output must follow from its number of positions; use backend='mpi'")
        announce = known is None or header != known
        self.said[(dest, positions)] = header
        self.sends.append(comm.send_message(header if announce else None, ts, dest, TAG))

    def _receive(self, v: int, j: int, positions: int) -> Any:
        source = self.stage.plan.owner(v - 1)[0]
        if source == self.rank:
            return self.local.pop((v, j))
        comm = self.stage.pipe_comm
        known = _known(self.heard.get((source, positions)))
        header, ts = comm.recv_message(source, TAG, known, self.stage.device)
        self.heard[(source, positions)] = header
        return header.rebuild(ts)


def _known(header: Any) -> Any:
    """A link's agreed header where later messages may leave it out: one with tensors (a
    message of none always carries its header, or nothing would travel at all)."""
    return header if header is not None and header.metas else None
