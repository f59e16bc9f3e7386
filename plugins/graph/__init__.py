"""Graph learning: the Graph Transformer (and GIN) on torch_geometric with every norm
(``norms``, GRANOLA in ``granola``), PATTERN/CLUSTER generated and FreeSolv shipped (``data``),
the task's parts of the run skeleton (``trainer``). docs/graphs.md."""
