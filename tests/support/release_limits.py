"""What a DeepSpeed release cannot do on CPU ranks, whatever deepspeed_bnb does: one definition for the tests that
skip there and the compatibility matrix that calls their claim n/a (tools/compat_matrix.py reads this file without
importing the test suite, so it holds plain values only)."""

# The first DeepSpeed release seen swapping to NVMe on CPU ranks. Earlier ones, stock alike: the parameter swapper
# asserts its buffers are pinned, which CPU memory never is, and the optimizer swapper waits on an empty queue (a C++
# assertion).
FIRST_CPU_SWAPPING = "0.19.8"
NO_CPU_SWAPPING = ("NVMe swappers cannot run on CPU ranks (pinned-memory assertions, stock DeepSpeed alike); "
                   f"{FIRST_CPU_SWAPPING} and later can")
