"""The fused path of the ZeRO step, one owner: which code steps each parameter, and running the kernel over a partition.

Read in this order (each module uses only those above it):
- ops/rules.py (below this package): one `UpdateRule` per bnb update rule with a kernel: its operator, reference,
  hyper row and the get_config values its kernel models.
- contract.py: whether the kernel computes a given parameter's own bnb update (pure functions of the optimizer class,
  the rule and the parameter's config).
- route.py: the decision, as `Route`s. `kernel_route` once per optimizer and device (the user's `FusedKernel` setting,
  the device, the build, the first-use check), then a `Route` per parameter at every step.
- partition.py: the kernel over the fused segments of one partition.
- partition_step.py: one partition's step: the kernel where the route says so, bnb's own update elsewhere.
"""
