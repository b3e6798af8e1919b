"""Classification: scores and labels (classify), their causal validation on each type's own claim, the HeadCatalog results file."""
