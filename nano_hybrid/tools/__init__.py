"""The command lines of ``scripts/`` that are not benchmarks: data preparation (``prepare_data``, ``prepare_corpus``,
``prepare_tokenizer``) and the seed study (``convergence_study``, ``compare_seeds``). One module per script, same
name: its arguments and ``main``; the work is in ``nano_hybrid.data``, ``nano_hybrid.convergence_study`` and
``nano_hybrid.seedstudy``."""
