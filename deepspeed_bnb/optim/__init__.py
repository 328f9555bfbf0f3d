"""Glue to bitsandbytes optimizers: state classes, the segment-wise update driver, and the fused path (fused/)."""
