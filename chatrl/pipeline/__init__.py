"""``train.py``'s pipeline, planned before anything runs: the presets per deployment and model size
(``presets``), the whole plan from the command line, every step's command line checked by its own
parser (``plan``), and the evaluation after the last step (``evaluation``). ``train.py`` keeps the
command line and the launching; the step parsers reach the plan as an argument (no step package is
imported here)."""
