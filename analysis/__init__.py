"""Analyses of trained runs (layer similarity, ...) for the paper's figures."""
