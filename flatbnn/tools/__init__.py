"""The commands a user runs besides training and evaluating (aggregate a sweep, analyse finished runs, ensembles,
heatmaps, cost table, data preparation, the toy reproductions): each module's ``main`` is its command line, run as
``python -m flatbnn.tools.<name>`` (some also as a ``flatbnn-<name>`` console script, pyproject.toml) from an
installed package, and as ``python scripts/<name>.py`` in a checkout (a thin entry that calls the same ``main``)."""
