"""``specdecode bench``: our engine against Hugging Face transformers ``generate()`` in one run.

Each system runs in its own subprocess, one after the other (``ours.py``, then ``peer_hf.py``),
so only one model is in memory at a time; ``command.py`` drives them and ``report.py`` checks
outputs, prints the table and writes the JSON and the plot.
"""
