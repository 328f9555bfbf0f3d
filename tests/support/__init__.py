"""Helpers of the test suite that are not tests: what the suite's processes and their children share.

Every module here is imported as `support.<module>`, with tests/ on sys.path: tests/conftest.py puts it there for the
suite's process, and the children the tests start with tests/ as their working folder find it there. A module here
that a launcher runs as a script (torchrun, accelerate launch or a plain child: distributed_scenarios.py,
nvme_scenarios.py, client_runs.py, cross_release_worker.py, legacy_bnb_runs.py, save_then_die.py, cuda_kernel_run.py)
puts it there itself, right after its standard-library imports, in the same two lines:

    TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, TESTS)  # `import support` (support/__init__.py)

and imports its siblings as `support.<module>` too, never by their bare names from its own folder (which Python puts
first on a script's sys.path): one module under two names would be two modules. Those children also inherit
tests/support/site on their PYTHONPATH (conftest.py), whose sitecustomize.py bounds every wait for a JIT build lock
(jit_guard.py).
"""
