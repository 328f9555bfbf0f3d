"""The folder `deepspeed-bnb run` puts first on PYTHONPATH: it holds the sitecustomize module Python runs at startup."""
