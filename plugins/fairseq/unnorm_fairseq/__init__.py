"""fairseq ``--user-dir`` plugin: registers the model ``unnorm_transformer`` and its
architectures (``unnorm_transformer_iwslt_de_en``, ``_wmt_en_fr``, ``_tiny``), and the
optimizers ``adamp`` and ``sgdp`` (the release's, ``optim``).

    fairseq-train DATA --user-dir plugins/fairseq/unnorm_fairseq --arch unnorm_transformer_iwslt_de_en \
        --encoder-normalize-before --decoder-normalize-before --norm-type un --un-window 4 ...

Its directory name is what fairseq imports it as, so it must not be ``fairseq``.
"""
from . import model, optim  # noqa: F401  (registers the model, architectures and optimizers)
