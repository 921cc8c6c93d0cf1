"""Moved to mlacheck.tools.aiter_triton_check (a bring-up tool, not a backend); this name keeps existing
command lines (`python -m mlacheck.backends.aiter_triton_check`) working. It imports nothing: backends/
never depends on the tools above it."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("mlacheck.tools.aiter_triton_check", run_name="__main__", alter_sys=True)
