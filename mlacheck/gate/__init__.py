"""GSM8K accuracy gate: lm-eval driver, run records, statistics, baselines.

Modules: ``task`` (the mirrored lm-eval task and scoring helpers), ``stats`` (pure
statistics), ``record`` (run records and baselines), ``lmeval_runner`` (runs lm-eval),
``compare`` (verdict, markdown, plot), ``cli`` (``mlacheck gate gsm8k ...``).
Importing this package does not import lm-eval, statsmodels or matplotlib.
"""
