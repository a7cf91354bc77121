"""lm-eval model adapter for MoEvement checkpoints: ``@register_model("moevement")``.

:class:`MoEvementLM` scores text with a dense checkpoint written by
``train.py --checkpoint.save_final DIR`` (or with a model given directly):

* ``loglikelihood``: the sum of the log-probabilities of the continuation's tokens given the
  context, and whether greedy decoding would produce them. Tokenisation follows lm-eval's
  causal models: trailing spaces of the context move to the continuation, the pair is encoded
  whole and split at the context's length; an empty context is replaced by the tokenizer's
  end-of-sequence id (the trainer's document separator).
* ``loglikelihood_rolling``: a document's log-likelihood, predicted from an end-of-sequence
  prefix in disjoint windows of ``max_length`` (= ``model.max_seq_len``) targets, each with as
  much left context as fits (lm-eval's rolling-window scheme).
* ``generate_until``: not supported (raises ``NotImplementedError``).

Every request becomes one or more *windows*: at most ``max_length`` input tokens (the left
ones are dropped) predicting at most ``max_length`` targets at the end. A continuation longer
than the window is scored in consecutive windows as well (lm-eval's HF model asserts instead).
Windows are sorted by length, batched, right-padded (causal attention: padding never reaches a
scored position) and run in fp32 under ``torch.inference_mode``. The model drops no token by
capacity in evaluation, so each token's routing and therefore each score is independent of batch
composition and padding.

From lm-eval's command line (``moevement-lm-eval``, :mod:`eval.lm_eval_cli`): ``--batch_size`` and
``--device`` apply as for lm-eval's own models (``auto`` batch sizes become 16; a CUDA device on a
machine without one falls back to the CPU, with a warning).

Data parallel: under ``torch.distributed`` the adapter reports its rank and world size, and
lm-eval's evaluator gives each rank every ``world_size``-th document and gathers the per-document
metrics on rank 0 through :meth:`all_gather` / :meth:`gather_object` / :meth:`barrier` (gloo).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: a non-empty registry is not filled later)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from eval.checkpoint import LoadedCheckpoint, load_checkpoint
from eval.errors import EvalError
from parallelisms import collectives
from trainer.data.tokenizer import Tokenizer, build_tokenizer

GENERATE_UNSUPPORTED = (
    "generate_until is not supported by the 'moevement' model adapter: it only scores "
    "log-likelihoods (multiple-choice tasks such as piqa and hellaswag, and perplexity tasks)"
)


def _usable_device(device: str | None) -> str:
    """``device``, or the CPU when none is given or it names CUDA on a machine without it (lm-eval's default)."""
    if not device:
        return "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        print(f"warning: device {device!r} requested but CUDA is not available; scoring on the CPU", file=sys.stderr)
        return "cpu"
    return str(device)


def score_windows(n_tokens: int, n_pred: int, max_length: int) -> list[tuple[int, int, int]]:
    """Windows that score the last ``n_pred`` of ``n_tokens`` tokens, each predicted once.

    Returns ``(input_start, input_end, n_targets)`` triples: the model reads
    ``tokens[input_start:input_end]`` (at most ``max_length`` tokens) and its last ``n_targets``
    positions predict ``tokens[input_end - n_targets + 1 : input_end + 1]``. Targets are cut in
    chunks of ``max_length`` from the first one; each window takes the ``max_length`` tokens
    before its last target as input. Needs ``1 <= n_tokens - n_pred`` (a first token to
    condition on).
    """
    first = n_tokens - n_pred
    if first < 1:
        raise ValueError(f"need a context token before the {n_pred} targets (got {n_tokens} tokens)")
    out = []
    for a in range(first, n_tokens, max_length):
        b = min(a + max_length, n_tokens)  # targets tokens[a:b]
        out.append((max(0, b - 1 - max_length), b - 1, b - a))
    return out


@register_model("moevement")
class MoEvementLM(LM):
    """lm-eval ``LM`` over a MoEvement dense checkpoint.

    ``MoEvementLM(checkpoint=DIR)`` loads ``DIR`` (see :func:`eval.checkpoint.load_checkpoint`;
    ``config`` / ``tokenizer`` choose the tokenizer); ``MoEvementLM(model=..., tokenizer=...)``
    wraps a model already in memory (``tokenizer``: a :class:`trainer.data.tokenizer.Tokenizer` or a
    spec string). Through lm-eval: ``moevement-lm-eval --model moevement --model_args checkpoint=DIR --batch_size 32``.
    """

    def __init__(
        self,
        checkpoint: str | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        config: str | None = None,
        batch_size: int | str = 16,
        device: str | None = None,
        max_length: int | None = None,
        **_unused: Any,
    ) -> None:
        super().__init__()
        device = _usable_device(device)
        self.checkpoint: LoadedCheckpoint | None = None
        if (checkpoint is None) == (model is None):
            raise EvalError("MoEvementLM: give exactly one of checkpoint=DIR or model=<module>")
        if checkpoint is not None:
            if tokenizer is not None and not isinstance(tokenizer, str):
                raise EvalError("MoEvementLM: with checkpoint=, tokenizer must be a spec string ('byte' or a path)")
            self.checkpoint = load_checkpoint(checkpoint, tokenizer=tokenizer, config=config, device=device)
            model, tokenizer = self.checkpoint.model, self.checkpoint.tokenizer
        elif tokenizer is None or isinstance(tokenizer, str):
            tokenizer = build_tokenizer(tokenizer or "byte")
        self.model = model.to(device).float().eval()
        self.tokenizer: Tokenizer = tokenizer
        self._device = torch.device(device)
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            batch_size = 16  # no memory probing: a fixed size that suits CPU and GPU scoring
        try:
            self.batch_size = int(batch_size)
        except (TypeError, ValueError):
            raise EvalError(f"MoEvementLM: batch_size must be a positive integer, got {batch_size!r}") from None
        if self.batch_size < 1:
            raise EvalError(f"MoEvementLM: batch_size must be >= 1, got {self.batch_size}")
        model_max = int(self.model.args.max_seq_len)
        self.max_length = model_max if max_length is None else int(max_length)
        if not 1 <= self.max_length <= model_max:
            raise EvalError(f"MoEvementLM: max_length must be in [1, model.max_seq_len={model_max}], got {max_length}")
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> MoEvementLM:
        """lm-eval's constructor from ``--model_args`` plus its ``--batch_size`` / ``--device``; a key given in
        both is taken from ``--model_args`` (lm-eval's default would pass it twice and fail)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MoEvementLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # -- tokenisation --------------------------------------------------------------
    @property
    def prefix_token_id(self) -> int:
        """Conditions the first token of an empty context or a rolling document: end-of-sequence."""
        return int(self.tokenizer.eos_id)

    @property
    def tokenizer_name(self) -> str:
        return repr(self.tokenizer)

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """``(context_ids, continuation_ids)`` as lm-eval's causal models split them."""
        if context == "":
            return [self.prefix_token_id], self.tok_encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        context_ids = self.tok_encode(context)
        return context_ids, whole[len(context_ids) :]

    # -- lm-eval API ---------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        seqs = []
        for context, continuation in (req.args for req in requests):
            ctx, cont = self.encode_pair(context, continuation)
            if not ctx:  # a context that tokenises to nothing (e.g. all whitespace) -> eos
                ctx = [self.prefix_token_id]
            seqs.append((ctx + cont, len(cont)))
        results = self.score_tokens(seqs, progress=self.progress(requests, disable_tqdm))
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        seqs = []
        for (text,) in (req.args for req in requests):
            ids = self.tok_encode(text)
            seqs.append(([self.prefix_token_id] + ids, len(ids)))
        results = [ll for ll, _ in self.score_tokens(seqs, progress=self.progress(requests, disable_tqdm))]
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(GENERATE_UNSUPPORTED)

    def progress(self, requests, disable: bool) -> ItemProgress:
        """A bar over the task items (documents) behind `requests`, on rank 0 of an interactive terminal."""
        items = [(getattr(r, "task_name", None), getattr(r, "doc_id", n)) for n, r in enumerate(requests)]
        tasks = sorted({task for task, _ in items if task})
        label = "eval " + " + ".join(tasks) if tasks else "eval"
        return ItemProgress(items, label, disable=disable or self.rank != 0 or not sys.stderr.isatty())

    # -- scoring -------------------------------------------------------------------
    @torch.inference_mode()
    def score_tokens(
        self, seqs: Sequence[tuple[Sequence[int], int]], progress: ItemProgress | None = None
    ) -> list[tuple[float, bool]]:
        """For each ``(tokens, n_pred)``: (sum of log p(token | tokens before it) over the last
        ``n_pred`` tokens, whether each of them is the argmax). ``n_pred == 0`` gives ``(0.0, True)``.
        ``progress`` hears of each sequence scored."""
        progress = progress or ItemProgress([(None, n) for n in range(len(seqs))], "scoring", disable=True)
        totals = [0.0] * len(seqs)
        greedy = [True] * len(seqs)
        remaining = [0] * len(seqs)
        windows = []  # (request index, input ids, target ids)
        for i, (tokens, n_pred) in enumerate(seqs):
            if n_pred == 0:
                continue
            tokens = list(tokens)
            for start, end, k in score_windows(len(tokens), n_pred, self.max_length):
                windows.append((i, tokens[start:end], tokens[end - k + 1 : end + 1]))
                remaining[i] += 1
        windows.sort(key=lambda w: -len(w[1]))  # longest first: the largest batch runs (or fails) first
        for i in (i for i, r in enumerate(remaining) if r == 0):
            progress.scored(i)
        for b in range(0, len(windows), self.batch_size):
            batch = windows[b : b + self.batch_size]
            width = len(batch[0][1])
            inputs = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (_, ids, _) in enumerate(batch):
                inputs[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logits = self.model(inputs.to(self._device))
            for row, (i, ids, targets) in enumerate(batch):
                n, k = len(ids), len(targets)
                logprobs = F.log_softmax(logits[row, n - k : n].float(), dim=-1)
                target = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
                totals[i] += float(logprobs.gather(1, target[:, None]).double().sum())
                greedy[i] = greedy[i] and bool((logprobs.argmax(dim=-1) == target).all())
                remaining[i] -= 1
                if remaining[i] == 0:
                    progress.scored(i)
        progress.close()
        return list(zip(totals, greedy))

    # -- data parallel (lm-eval's evaluator splits documents across ranks) -----------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        tensor = tensor.cpu()  # the group is gloo
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        collectives.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        collectives.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            collectives.barrier()

    def get_model_info(self) -> dict[str, Any]:
        """Recorded in the results' ``config`` by ``lm_eval.simple_evaluate``."""
        info: dict[str, Any] = {
            "max_length": self.max_length,
            "tokenizer": self.tokenizer_name,
            "world_size": self.world_size,
        }
        if self.checkpoint is not None:
            info.update(
                checkpoint=self.checkpoint.directory,
                checkpoint_step=self.checkpoint.step,
                tokenizer_source=self.checkpoint.tokenizer_source,
            )
        return info


def requests_from_pairs(pairs: Iterable[tuple]) -> list:
    """Minimal stand-ins for ``lm_eval.api.instance.Instance`` (only ``args`` is read): for
    calling the adapter directly, e.g. ``lm.loglikelihood(requests_from_pairs([("Q:", " A")]))``."""

    class _Request:
        __slots__ = ("args",)

        def __init__(self, args):
            self.args = tuple(args)

    return [_Request(p) for p in pairs]


class ItemProgress:
    """Counts items, not requests: an item (a task's document) is done when all its requests are scored."""

    def __init__(self, items: Sequence[tuple], label: str, disable: bool):
        self.item_of = list(items)
        self.left: dict[tuple, int] = {}
        for item in self.item_of:
            self.left[item] = self.left.get(item, 0) + 1
        self.total, self.done = len(self.left), 0
        self.bar = tqdm(total=self.total, desc=label, unit="item", disable=disable, dynamic_ncols=True)

    def scored(self, request: int) -> None:
        """Request number `request` (in the order given) is scored."""
        item = self.item_of[request]
        self.left[item] -= 1
        if self.left[item] == 0:
            self.done += 1
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
