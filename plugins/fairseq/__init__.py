"""fairseq adapter for translation. fairseq 0.12.2 runs in its own Python 3.10 environment
(``make fairseq-env``); ``launcher`` runs in the main one and launches the modules that run in
fairseq's: ``train`` (fairseq-train with the norms' loss-scale guard), ``checkpoints``
(fairseq checkpoints read without running their pickle), ``average_checkpoints`` and
``unnorm_fairseq/`` (fairseq's ``--user-dir``: the model)."""
