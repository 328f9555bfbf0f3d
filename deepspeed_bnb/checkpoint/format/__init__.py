"""What a deepspeed_bnb checkpoint is on disk, and reading, verifying, publishing and retiring it safely."""
