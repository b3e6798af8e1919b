"""Infrastructure below everything: errors, registries, input checks, placement, processes, progress, exact JSON, head names, statistics helpers, figures."""
