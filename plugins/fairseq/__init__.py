"""fairseq adapter for translation. fairseq 0.12.2 runs in its own Python 3.10 environment
(``make fairseq-env``); this package's modules run in the main one and launch fairseq's
executables there, except ``unnorm_fairseq/`` (fairseq's ``--user-dir``: the model) and
``average_checkpoints.py``, which run inside fairseq's environment."""
