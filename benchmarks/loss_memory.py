"""Peak host memory and time of the last stage's loss with whole-vocabulary logits and chunked.

    python -m benchmarks.loss_memory [--tokens 4096] [--vocab 152064] [--dim 256] [--chunks 0,1024]

Each variant (``training.loss_chunk_tokens``; 0: the whole micro-batch's logits from forward) runs in a
fresh process: hidden states [1, tokens, dim] -> final norm -> head -> cross-entropy, forward and
backward, on a model part holding only the head. Prints the peak resident memory the loss adds to the
process (``ru_maxrss``), the forward+backward seconds and the loss. The logits' size depends on tokens
and vocabulary only; a small ``dim`` keeps the head's GEMMs short on a CPU.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

import torch

from models import ModelArgs, Transformer


def measure(tokens: int, vocab: int, dim: int, chunk: int) -> str:
    """One variant, in this process: ``peak_mb=<added peak RSS> seconds=<fwd+bwd> loss=<value>``."""
    args = ModelArgs(family="gpt", vocab_size=vocab, dim=dim, n_layers=1, n_heads=4, max_seq_len=tokens,
                     n_dense_layers=1, n_routed_experts=2, top_k=1)  # fmt: skip
    with torch.device("meta"):
        head = Transformer(args)
    del head.layers["0"]
    head.tok_embeddings = None  # a last pipeline stage without layers: final norm and head
    head.to_empty(device="cpu")
    torch.manual_seed(0)
    head.init_weights()
    head.loss_chunk_tokens = chunk
    hidden = torch.randn(1, tokens, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    loss = head.loss(head(hidden), labels)
    loss.backward()
    seconds = time.perf_counter() - start
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return f"peak_mb={peak_mb:.0f} seconds={seconds:.2f} loss={loss.item():.6f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=152064)  # Qwen1.5-MoE's
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--chunks", default="0,1024", help="loss_chunk_tokens values, comma-separated")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child is not None:
        print(measure(opts.tokens, opts.vocab, opts.dim, opts.child))
        return
    logits_mb = opts.tokens * opts.vocab * 4 / 2**20
    print(f"tokens={opts.tokens} vocab={opts.vocab} dim={opts.dim} float32 logits={logits_mb:.0f} MB")
    for chunk in [int(c) for c in opts.chunks.split(",")]:
        cmd = [sys.executable, "-m", "benchmarks.loss_memory", "--tokens", str(opts.tokens), "--vocab",
               str(opts.vocab), "--dim", str(opts.dim), "--child", str(chunk)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
        print(f"loss_chunk_tokens={chunk} {out}")


if __name__ == "__main__":
    main()
