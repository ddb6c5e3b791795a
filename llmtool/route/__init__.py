"""`llmtool route`: token-level collaboration of domain experts (FusionRoute) and its baselines."""
