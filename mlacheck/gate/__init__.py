"""Accuracy gates over lm-eval tasks (GSM8K first): lm-eval driver, run records, statistics,
baselines.

Modules: ``task`` (a task: pinned lm-eval config, data layout, scoring mirror), ``tasks``
(the registry and the built-in tasks), ``stats`` (pure statistics), ``record`` (run records
and baselines), ``lmeval_runner`` (runs lm-eval), ``compare`` (verdict, markdown, plot),
``cli`` (``mlacheck gate <task> ...``). Importing this package does not import lm-eval,
statsmodels or matplotlib.
"""
