"""The benchmark harness: not the method, but how it is measured. Needle contexts, one prefill
replayed into every method's cache and the scores (quality.py), speed and memory through the real
path (speed.py), a run's files (report.py), the tools that look closer (profile_decode.py,
profile_prefill.py, layer_swap.py, kernel_bench.py), and the prepared GPU check (gpu_check.py). It imports the
method's modules; the method never imports it."""
