"""Engine replicas on Ray Serve behind one OpenAI-compatible ingress (`specdec cluster`).

Needs the ``cluster`` extra (Ray Serve) to run. ``command``, ``options``, ``prefix``, ``metrics``
and ``registry`` import without Ray (the CLI parser loads ``command``); ``specdec serve`` never
imports this package's Ray modules (tested).
"""
