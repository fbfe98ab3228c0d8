"""The conformance corpus: every technique of the suite on modules unlike the ones it was built on, against plain
Lightning, cell by cell (module x flag, and on two hosts x Lightning's own callbacks).

- ``corpus.py`` (+ ``corpus_hf.py``, ``corpus_nets.py``, ``corpus_lightning.py``): the modules;
- ``flags.py``: the flags, the plain run each is judged against and why; ``companions.py``: Lightning's callbacks;
- ``cell.py``: one cell through a real ``Trainer.fit``; ``compare.py``: the verdicts; ``dryrun.py``: the dry run
  per module (predicted vs measured peak);
- ``run.py``: the sweep (``make conformance``: resumable, sharded, one spawned worker at a time, ``worker.py``),
  ``report.py``: ``benchmarks/results/conformance.{json,md}``; ``screen.py``: which transformers families build;
- ``test_slice.py``: the fast slice ``make test`` runs; ``test_harness.py``: the harness finds planted bugs;
- ``known_bugs.py``: the failures that are known bugs; ``known/``: a reproduction of each one the sweep found.

Re-run after a fix: ``make conformance`` (or ``python tests/conformance/run.py``; a change to the package re-runs
every cell), one shard: ``python tests/conformance/run.py --modules 'hf_*' --groups torch --flags lowmem_offload``.
"""
