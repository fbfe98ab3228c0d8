"""``lowmem consolidate CHECKPOINT_DIR OUT_FILE``: a DeepSpeed ZeRO directory checkpoint -> one fp32 state dict."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from lightning_lowmem.strategies.zero.consolidation import consolidate


def consolidate_main(argv: Sequence[str] | None = None) -> int:
    """``lowmem consolidate CHECKPOINT_DIR OUT_FILE [--tag TAG] [--strip-prefix model.]``."""
    parser = argparse.ArgumentParser(prog="lowmem consolidate", description="Write a DeepSpeed ZeRO directory "
                                     "checkpoint as one plain fp32 state dict.")
    parser.add_argument("checkpoint_dir", help="the directory Trainer.save_checkpoint wrote with a lowmem_zero* strategy")
    parser.add_argument("out_file", help="output file (.pt/.ckpt: torch.save; .safetensors: safetensors)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in `latest`)")
    parser.add_argument("--strip-prefix", default="", help="drop this key prefix, e.g. `model.` for the bare HF model")
    parser.add_argument("--trusted", action="store_true", help="the checkpoint is yours: allow a full (code-running) "
                        "unpickling of its files where weights-only refuses")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    state = consolidate(args.checkpoint_dir, args.out_file, tag=args.tag, strip_prefix=args.strip_prefix,
                        trusted=args.trusted)
    n = sum(t.numel() for t in state.values())
    print(f"Wrote {len(state)} tensors ({n:,} elements, fp32) to {args.out_file}")
    return 0
