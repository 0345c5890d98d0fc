"""Ray Data pipelines. images.py: image classification; order.py: the global sample order; synth.py: demo data."""
