"""Which ``transformers`` families build from a small config on the CPU and train: every model type of the five
auto mappings the corpus draws from (causal LM, seq2seq LM, sequence, image and audio classification), built with
the corpus's generic tiny sizes and trained for two steps in plain Lightning (in one child process, restarted
after a family that kills it).

    python tests/conformance/screen.py          # writes benchmarks/results/conformance_families.json

The result lists every family with its status: ``in corpus`` (``corpus_hf.FAMILIES``), ``screened: trains`` (builds
and trains with the generic sizes; left out of the sweep for its time, add it to ``FAMILIES`` to sweep it) or
``left out: <the error>`` (needs another input, an extra package, or sizes the generic ones do not give).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MAPPINGS = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "encoder_cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "vision_cls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audio_cls": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
}
TIMEOUT_S = 120
# NOTE: a family whose generic tiny config still allocates gigabytes (a default vocabulary or image size the generic
# sizes do not shrink) took 20 GB and more of this 24 GB machine: each child's heap is capped, and such a family is
# left out with the allocation it asked for
MEMORY_LIMIT = 4 << 30


def candidates() -> list[tuple[str, str]]:
    """(model type, kind): each model type once, under the first kind (in MAPPINGS order) that maps it."""
    from transformers.models.auto import modeling_auto

    seen, out = set(), []
    for kind, mapping in MAPPINGS.items():
        for model_type in getattr(modeling_auto, mapping):
            if model_type not in seen and model_type[0].islower():
                seen.add(model_type)
                out.append((model_type, kind))
    return out


def _child(pairs: list[str]) -> None:
    """Screen ``TYPE:KIND`` pairs in this process, one line ``RESULT<TAB>TYPE<TAB>STATUS`` each."""
    import gc
    import logging
    import resource
    import signal
    import traceback
    import warnings

    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_LIMIT, MEMORY_LIMIT))

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import lightning as L
    import torch

    from tests.conformance.corpus_hf import Family, HFModule

    torch.set_num_threads(1)

    def alarm(signum, frame):
        raise TimeoutError(f"did not train 2 steps within {TIMEOUT_S} s at the generic tiny sizes")

    signal.signal(signal.SIGALRM, alarm)
    for pair in pairs:
        model_type, kind = pair.rsplit(":", 1)
        print(f"START\t{model_type}", flush=True)
        signal.alarm(TIMEOUT_S)
        try:
            torch.manual_seed(0)
            module = HFModule(Family(model_type, kind))
            L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(module)
            status = f"screened: trains ({sum(p.numel() for p in module.parameters())} params)"
        except BaseException as err:  # noqa: BLE001 - every failure is a reason to leave the family out
            frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
            where = f" ({frame.filename.split('site-packages/')[-1]}:{frame.lineno})" if frame else ""
            heap = isinstance(err, MemoryError) or "can't allocate memory" in str(err)
            cap = f"over the screen's {MEMORY_LIMIT >> 30} GiB heap cap (RLIMIT_DATA) at the generic tiny sizes: "
            status = "left out: " + (cap if heap else "") + " ".join(f"{type(err).__name__}: {err}".split())[:220] + where
        finally:
            signal.alarm(0)
            module = None
            gc.collect()
        print(f"RESULT\t{model_type}\t{status}", flush=True)


def screen(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """Status by model type; a family that ran out of the heap is tried again alone in a fresh child (the heap of one
    child grows with the families before it: 50 were refused 18 MiB and more after others in the same child)."""
    out = _screen([f"{t}:{k}" for t, k in pairs])
    for pair in [f"{t}:{k}" for t, k in pairs if _out_of_heap(out[t])]:
        out.update(_screen([pair]))
    return out


def _out_of_heap(status: str) -> bool:
    # NOTE: oneDNN says "could not create a primitive" when its own allocation fails
    return status.startswith(f"left out: over the screen's {MEMORY_LIMIT >> 30} GiB heap cap") or "create a primitive" in status


def _screen(todo: list[str]) -> dict[str, str]:
    """Status by model type, the families in one child; a child that dies is restarted after the family it died on."""
    out: dict[str, str] = {}
    while todo:
        done = subprocess.run([sys.executable, __file__, "--child", *todo], cwd=ROOT, capture_output=True, text=True,
                              check=False)
        started = None
        for line in done.stdout.splitlines():
            parts = line.split("\t")
            if parts[0] == "START":
                started = parts[1]
            elif parts[0] == "RESULT":
                out[parts[1]], started = parts[2], None
        if started is not None:
            out[started] = f"left out: the process died while training it (exit status {done.returncode})"
        todo = [p for p in todo if p.rsplit(":", 1)[0] not in out]
        if started is None and todo:  # died before starting any: give up on the rest
            for p in todo:
                out[p.rsplit(":", 1)[0]] = f"left out: the screening process failed ({done.stderr[-200:]})"
            todo = []
    return out


def main() -> int:
    from tests.conformance.corpus_hf import FAMILIES

    in_corpus = {f.model_type: f.kind for f in FAMILIES}
    pairs = candidates()
    statuses = screen([(t, k) for t, k in pairs if t not in in_corpus])
    rows = []
    for model_type, kind in pairs:
        status = "in corpus" if model_type in in_corpus else statuses[model_type]
        rows.append({"model_type": model_type, "kind": in_corpus.get(model_type, kind), "status": status})
        print(f"{model_type:36s} {kind:12s} {status[:150]}", flush=True)
    trains = sum(r["status"].startswith("screened") for r in rows)
    summary = (f"{len(rows)} model types in the five auto mappings: {len(in_corpus)} in the corpus, {trains} more build "
               f"and train at the generic tiny sizes (left out of the sweep for its time: add them to "
               f"`corpus_hf.FAMILIES`), {len(rows) - len(in_corpus) - trains} left out with the error shown "
               f"(`python tests/conformance/screen.py`).")
    from datetime import datetime, timezone

    from tests.conformance.report import _machine

    out = ROOT / "benchmarks" / "results" / "conformance_families.json"
    out.write_text(json.dumps({
        "benchmark": "conformance_families", "title": "Which transformers families the conformance corpus holds, and "
        "why each other one is left out (CPU)", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python tests/conformance/screen.py", "machine": _machine(), "summary": summary, "families": rows,
    }, indent=1) + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
