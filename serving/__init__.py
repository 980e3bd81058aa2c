"""Serving many requests at once: B sequences decoding together are more KV heads of one ragged
cache (`batch.py`), and `scheduler.decode` runs generate.decode's loop over them. The method answers
from one cache; its modules import none of this."""
