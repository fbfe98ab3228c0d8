"""The only modules of the package that touch private Lightning, torch, DeepSpeed and Python-frame APIs.

Each lists the private names it uses, checked by ``tests/test_internals.py``; it imports nothing else of
``lightning_lowmem`` (the import contract of ``pyproject.toml``).
"""
