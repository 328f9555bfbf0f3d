"""deepspeed_bnb checkpoints: the on-disk format and its safe reading and publishing (format/), and the offline tools
that rewrite checkpoints (tools/)."""
