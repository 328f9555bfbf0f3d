"""The offline checkpoint tools (`deepspeed-bnb` verbs): reshape, migrate, convert, export, universal, summary."""
