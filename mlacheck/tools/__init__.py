"""Bring-up tools: command-line runners for a backend on a new machine, outside pytest.

They sit above the pipeline (a tool may run the harness), so nothing in mlacheck imports
them, and backends/ never does:

    python -m mlacheck.tools.aiter_triton_check --device cuda --rope   # docs/aiter-triton.md
    python -m mlacheck.tools.flashinfer_prebuild --archive aot.tar.xz  # docs/flashinfer.md
"""
