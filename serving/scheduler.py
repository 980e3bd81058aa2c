"""Many requests decoding together, as a library call: generate.decode's loop (each request's
questions answered in turn from its own cache, rolled back after each) with up to batch_size
requests' rows in one Batch (serving/batch.py). `python generate.py --batch` makes its Batch at its
command line (commands/generate.py) and runs the same loop."""
import generate
from serving.batch import batch_for


def decode(model, requests, batch_size=1, stop_ids=(), answer_stop_ids=None, temperature=0.0,
           top_p=1.0, ends_line=None):
    """generate.decode with at most batch_size requests answering at once, their rows in one new
    Batch in the model's dtype and device (batch_size 1: each on its own cache); its events."""
    return generate.decode(model, requests, batch_size, stop_ids, answer_stop_ids, temperature,
                           top_p, ends_line, batch_for(model, batch_size))
