"""The only modules of the package that touch private Lightning, torch, DeepSpeed and Python-frame APIs.

One module per library (:mod:`.lightning`, :mod:`.torch`, :mod:`.deepspeed`, :mod:`.frames`). Each lists the private
names it uses (``PRIVATE_SYMBOLS`` and friends) and ``tests/test_internals.py`` asserts that every one exists in the
installed versions: an upgrade that removes one fails that test, by name, not a training step. The rest of the package
reaches these APIs only through the functions here (``tests/test_package.py`` checks it), and the import contract of
``pyproject.toml`` keeps this package at the bottom: it imports nothing else of ``lightning_lowmem``.
"""
