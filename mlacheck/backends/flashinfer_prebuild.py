"""Moved to mlacheck.tools.flashinfer_prebuild (a bring-up tool, not a backend); this name keeps existing
command lines (`python -m mlacheck.backends.flashinfer_prebuild`) working. It imports nothing: backends/
never depends on the tools above it."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("mlacheck.tools.flashinfer_prebuild", run_name="__main__", alter_sys=True)
