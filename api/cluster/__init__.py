"""Engine replicas on Ray Serve behind one OpenAI-compatible ingress (`specdec cluster`).

Needs the ``cluster`` extra (Ray Serve). Only ``options`` and ``command`` import without Ray;
``specdec serve`` never imports this package's Ray modules.
"""
