"""kvchat's inference engine: paged KV cache, prefix cache, background thread, CLI and local API."""
import os

# On a small, busy CPU, OpenMP threads that spin while waiting steal cycles from each other.
# It must be set before torch loads OpenMP, hence here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
